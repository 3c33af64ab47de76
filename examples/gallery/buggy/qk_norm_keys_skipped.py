"""Qwen 3-style attention whose keys skip their norm: k_norm is built and never applied."""

import torch
import torch.nn.functional as F
from torch import nn


class HeadRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))  # as if trained: uneven

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale).to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class QwenStyleAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, n_kv_heads=2, max_len=64):
        super().__init__()
        self.h, self.kv = n_heads, n_kv_heads
        self.hd = d_model // n_heads
        self.W_query = nn.Linear(d_model, n_heads * self.hd, bias=False)
        self.W_key = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.W_value = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.out_proj = nn.Linear(n_heads * self.hd, d_model, bias=False)
        self.q_norm, self.k_norm = HeadRMSNorm(self.hd), HeadRMSNorm(self.hd)
        inv = 1.0 / 1_000_000.0 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", torch.cat([ang, ang], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([ang, ang], -1).sin(), persistent=False)

    def rope(self, t):
        n = t.shape[-2]
        return t * self.cos[:n] + rotate_half(t) * self.sin[:n]

    def forward(self, x):
        b, n, _ = x.shape
        q = self.W_query(x).view(b, n, self.h, self.hd).transpose(1, 2)
        k = self.W_key(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        v = self.W_value(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        q, k = self.rope(self.q_norm(q)), self.rope(k)  # bug: self.k_norm unused
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {
    "target": "QwenStyleAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "init": {"d_model": 32, "n_heads": 4, "n_kv_heads": 2},
}
