"""Causal single-head attention whose forward takes keyword-only extras: forward(x, *, mask=None, cache=None)."""

import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.context_length = context_length

    def forward(self, x, *, mask=None, cache=None):
        q = self.W_query(x)
        k = self.W_key(x)
        v = self.W_value(x)
        if cache is not None:
            k = torch.cat([cache["k"], k], dim=-2)
            v = torch.cat([cache["v"], v], dim=-2)
            cache["k"], cache["v"] = k, v
        t_q, t_k = q.shape[-2], k.shape[-2]
        if mask is None:
            mask = torch.ones(t_q, t_k, dtype=torch.bool, device=x.device).triu(t_k - t_q + 1)
        scores = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5
        scores = scores.masked_fill(mask, float("-inf"))
        w = self.dropout(scores.softmax(dim=-1))
        return w @ v


EXPECT = {"target": "CausalAttention", "kind": "causal", "ok": True}
