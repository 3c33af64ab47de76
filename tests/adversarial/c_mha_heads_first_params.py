"""Multi-head attention with heads-first weight tensors (heads, d_in, head_dim) and einsum."""

import math

import torch
import torch.nn as nn


class HeadsFirstMHA(nn.Module):
    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        self.h = num_heads
        self.hd = d_out // num_heads
        self.wq = nn.Parameter(torch.randn(num_heads, d_in, self.hd) / math.sqrt(d_in))
        self.wk = nn.Parameter(torch.randn(num_heads, d_in, self.hd) / math.sqrt(d_in))
        self.wv = nn.Parameter(torch.randn(num_heads, d_in, self.hd) / math.sqrt(d_in))
        self.proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        q = torch.einsum("btd,hde->bhte", x, self.wq)
        k = torch.einsum("btd,hde->bhte", x, self.wk)
        v = torch.einsum("btd,hde->bhte", x, self.wv)
        s = torch.einsum("bhqe,bhke->bhqk", q, k) / math.sqrt(self.hd)
        a = s.softmax(-1)
        o = torch.einsum("bhqk,bhke->bqhe", a, v)
        return self.proj(o.flatten(2))


EXPECT = {"target": "HeadsFirstMHA", "kind": "multihead", "ok": True}
