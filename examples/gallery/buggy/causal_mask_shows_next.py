"""Causal attention with keep-mask torch.tril(..., diagonal=1): each token sees one future token."""

import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        keep = torch.tril(torch.ones(context_length, context_length), diagonal=1)
        self.register_buffer("keep", keep)

    def forward(self, x):
        n = x.shape[-2]
        q = self.W_query(x)
        k = self.W_key(x)
        v = self.W_value(x)
        scores = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5
        scores = scores.masked_fill(self.keep[:n, :n] == 0, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


EXPECT = {
    "target": "CausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
}
