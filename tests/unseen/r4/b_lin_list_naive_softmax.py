"""Attention with self.lin[0..3] and heads as self.h; bug: a hand-written softmax, exp(att) / exp(att).sum(-1), that overflows for large scores."""

import math

import torch
import torch.nn as nn


class ListAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.h = num_heads
        self.dk = embed_dim // num_heads
        self.lin = nn.ModuleList([nn.Linear(embed_dim, embed_dim) for _ in range(4)])
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        nb = x.size(0)
        q, k, v = (self.lin[i](x).view(nb, -1, self.h, self.dk).transpose(1, 2) for i in range(3))
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dk)
        if mask is not None:
            att = att.masked_fill(mask == 0, -1e9)
        e = torch.exp(att)
        att = self.drop(e / e.sum(dim=-1, keepdim=True))
        out = torch.matmul(att, v).transpose(1, 2).reshape(nb, -1, self.h * self.dk)
        return self.lin[3](out)


EXPECT = {
    "target": "ListAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "unstable_softmax",
    "style": "self.lin[0..3] ModuleList, heads as self.h, x.size(0) batch",
}
