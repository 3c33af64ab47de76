"""Causal attention: additive -1e9 mask buffer fused into torch.baddbmm(alpha=1/sqrt(d_k))."""

import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        bias = torch.triu(torch.full((context_length, context_length), -1e9), diagonal=1)
        self.register_buffer("attn_bias", bias)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.W_query(x)
        k = self.W_key(x)
        v = self.W_value(x)
        scores = torch.baddbmm(
            self.attn_bias[:t, :t].expand(b, t, t), q, k.transpose(1, 2), alpha=k.shape[-1] ** -0.5
        )
        weights = self.dropout(scores.softmax(dim=-1))
        return torch.bmm(weights, v)


EXPECT = {"target": "CausalAttention", "kind": "causal", "ok": True}
