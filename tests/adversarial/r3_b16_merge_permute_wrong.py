"""BERT-like multi-head attention merging heads with permute(0, 2, 3, 1): features ordered (head_dim, heads)."""

import math

import torch
import torch.nn as nn


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out = nn.Linear(d_out, d_out)

    def split(self, x):
        return x.view(x.size(0), x.size(1), self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        ctx = torch.matmul(s.softmax(-1), v)  # (b, h, t, hd)
        ctx = ctx.permute(0, 2, 3, 1).reshape(x.size(0), x.size(1), -1)
        return self.out(ctx)


EXPECT = {
    "target": "MultiHeadSelfAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "output",
    "mistake": "heads_merge",
}
