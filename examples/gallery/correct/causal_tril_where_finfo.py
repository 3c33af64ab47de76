"""Causal attention: tril bool mask, torch.where(..., finfo(dtype).min); batched or unbatched."""

import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        n = x.shape[-2]
        q = self.W_query(x)
        k = self.W_key(x)
        v = self.W_value(x)
        scores = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5
        keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device))
        scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
        weights = self.dropout(torch.softmax(scores, dim=-1))
        return weights @ v


EXPECT = {"target": "CausalAttention", "kind": "causal", "ok": True}
