"""Causal attention with a -1e9 fill (fine) that forgets to divide the scores by sqrt(d_k)."""

import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        t = x.shape[-2]
        q = self.W_query(x)
        k = self.W_key(x)
        v = self.W_value(x)
        scores = q @ k.transpose(-2, -1)
        scores = scores.masked_fill(self.mask[:t, :t] == 0, -1e9)
        weights = self.dropout(torch.softmax(scores, dim=-1))
        return weights @ v


EXPECT = {
    "target": "CausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "missing_scale",
}
