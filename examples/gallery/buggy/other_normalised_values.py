"""Causal attention that L2-normalises the value vectors (F.normalize) before mixing them."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1).bool()
        self.register_buffer("mask", mask)

    def forward(self, x):
        n = x.shape[-2]
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = F.normalize(self.W_value(x), dim=-1)
        attn_scores = queries @ keys.transpose(-2, -1) / keys.shape[-1] ** 0.5
        attn_scores = attn_scores.masked_fill(self.mask[:n, :n], float("-inf"))
        return torch.softmax(attn_scores, dim=-1) @ values


EXPECT = {
    "target": "CausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "values",
    "mistake": "other",
}
