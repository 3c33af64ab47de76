"""Causal self-attention block wrapping nn.MultiheadAttention(batch_first=True) with a float mask."""

import torch
import torch.nn as nn


class CausalSelfAttentionBlock(nn.Module):
    def __init__(self, d_model, n_heads, context_length, dropout=0.0):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        mask = torch.triu(torch.full((context_length, context_length), float("-inf")), diagonal=1)
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x):
        T = x.size(1)
        y, _ = self.attn(x, x, x, attn_mask=self.attn_mask[:T, :T], need_weights=False)
        return y


EXPECT = {"target": "CausalSelfAttentionBlock", "kind": "causal-multihead", "ok": True}
