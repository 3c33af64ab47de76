"""Grouped-query attention whose key/value heads reach the query heads with repeat, not
repeat_interleave: query head h reads kv head h % kv_heads instead of h // group."""

import math

import torch
from torch import nn


class GroupedAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.h, self.kv = n_heads, n_kv_heads
        self.hd = d_model // n_heads
        self.wq = nn.Linear(d_model, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, d_model, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        k = k.repeat(1, self.h // self.kv, 1, 1)  # bug: tiles the heads, 0 1 0 1
        v = v.repeat(1, self.h // self.kv, 1, 1)
        att = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        att = att.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = att.softmax(-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {
    "target": "GroupedAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "init": {"d_model": 32, "n_heads": 4, "n_kv_heads": 2},
}
