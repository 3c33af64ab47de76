"""Causal attention with torch.baddbmm: a -inf upper-triangle mask as `input`, alpha = 1/sqrt(d_k)."""

import torch
import torch.nn as nn


class BaddbmmCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.d_out = d_out

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        mask = torch.triu(torch.full((t, t), float("-inf"), dtype=x.dtype), diagonal=1)
        mask = mask.unsqueeze(0).expand(b, t, t)
        scores = torch.baddbmm(mask, q, k.transpose(1, 2), beta=1.0, alpha=self.d_out**-0.5)
        return torch.bmm(torch.softmax(scores, dim=-1), v)


EXPECT = {"target": "BaddbmmCausalAttention", "kind": "causal", "ok": True}
