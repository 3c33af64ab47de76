"""Causal attention that "zeroes out" future scores with masked_fill(mask, 0.0) before softmax."""

import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5
        attn_scores = attn_scores.masked_fill(self.mask.bool()[:num_tokens, :num_tokens], 0.0)
        attn_weights = self.dropout(torch.softmax(attn_scores, dim=-1))
        return attn_weights @ values


EXPECT = {
    "target": "CausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
}
