"""Meta-style rotary embedding as complex multiplication (interleaved pairs), one shared
key/value head (multi-query), explicit scores and a triangular mask."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MultiQueryRotary(nn.Module):
    def __init__(self, dim=24, n_heads=4, theta=500000.0, max_len=64):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        freqs = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(max_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def rotate(self, t):
        n = t.shape[1]
        tc = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        turned = tc * self.freqs_cis[:n].view(1, n, 1, -1)
        return torch.view_as_real(turned).flatten(3).type_as(t)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.rotate(self.wq(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.rotate(self.wk(x).view(b, n, 1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, n, 1, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)  # k broadcasts over heads
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        weights = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, n, -1)
        return self.wo(out)


EXPECT = {"target": "MultiQueryRotary", "kind": "causal-multihead", "ok": True}
