"""More implementations in other styles (correct unless the comment names a bug), written
after the gallery to probe the checker; see tests/test_check_variants.py."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class SquareRaw(nn.Module):  # raw square (out,in) params applied with F.linear
    def __init__(self, dim):
        super().__init__()
        self.query_weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.key_weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.value_weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        q, k, v = (
            F.linear(x, self.query_weight),
            F.linear(x, self.key_weight),
            F.linear(x, self.value_weight),
        )
        return F.scaled_dot_product_attention(q, k, v)


class HiddenHeads(nn.Module):  # heads stored under an odd name
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.nh = n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            l(x).view(b, t, self.nh, -1).transpose(1, 2) for l in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class KeepMask(nn.Module):  # bool keep-mask buffer
    def __init__(self, d_in, d_out, block_size):
        super().__init__()
        self.key = nn.Linear(d_in, d_out, bias=False)
        self.query = nn.Linear(d_in, d_out, bias=False)
        self.value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer(
            "keep", torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        )

    def forward(self, x, attention_mask=None):
        t = x.size(-2)
        k, q, v = self.key(x), self.query(x), self.value(x)
        wei = q @ k.transpose(-2, -1) * k.size(-1) ** -0.5
        wei = wei.masked_fill(~self.keep[:t, :t], float("-inf"))
        return F.softmax(wei, dim=-1) @ v


class UnbatchedOnlyMHA(nn.Module):  # per-head params tensor (H, d_in, hd)
    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.W_q = nn.Parameter(torch.randn(d_in, d_out) * 0.3)
        self.W_k = nn.Parameter(torch.randn(d_in, d_out) * 0.3)
        self.W_v = nn.Parameter(torch.randn(d_in, d_out) * 0.3)
        self.W_o = nn.Parameter(torch.randn(d_out, d_out) * 0.3)

    def forward(self, x):
        t = x.shape[0]
        q, k, v = (
            (x @ W).view(t, self.num_heads, -1).transpose(0, 1)
            for W in (self.W_q, self.W_k, self.W_v)
        )
        a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), -1)
        return (a @ v).transpose(0, 1).reshape(t, -1) @ self.W_o
