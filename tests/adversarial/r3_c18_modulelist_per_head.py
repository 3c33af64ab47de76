"""Causal multi-head attention: nn.ModuleList of per-head q/k/v nn.Linear, cat, then out projection."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        head_dim = d_out // num_heads
        self.queries = nn.ModuleList(
            [nn.Linear(d_in, head_dim, bias=qkv_bias) for _ in range(num_heads)]
        )
        self.keys = nn.ModuleList(
            [nn.Linear(d_in, head_dim, bias=qkv_bias) for _ in range(num_heads)]
        )
        self.values = nn.ModuleList(
            [nn.Linear(d_in, head_dim, bias=qkv_bias) for _ in range(num_heads)]
        )
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("tril", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        T = x.shape[1]
        outs = []
        for wq, wk, wv in zip(self.queries, self.keys, self.values):
            q, k, v = wq(x), wk(x), wv(x)
            att = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
            att = att.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
            att = self.dropout(F.softmax(att, dim=-1))
            outs.append(att @ v)
        return self.proj(torch.cat(outs, dim=-1))


EXPECT = {"target": "MultiHeadAttention", "kind": "causal-multihead", "ok": True}
