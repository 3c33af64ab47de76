"""Causal attention adding a registered float buffer: -inf above the diagonal, 0 elsewhere."""

import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "causal_bias",
            torch.full((context_length, context_length), float("-inf")).triu(1),
            persistent=False,
        )

    def forward(self, x):
        T = x.shape[-2]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        scores = q @ k.transpose(-1, -2) * k.shape[-1] ** -0.5
        scores = scores + self.causal_bias[:T, :T]
        return self.dropout(torch.softmax(scores, dim=-1)) @ v


EXPECT = {"target": "CausalAttention", "kind": "causal", "ok": True}
