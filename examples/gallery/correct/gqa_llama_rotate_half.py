"""Llama-style grouped-query attention: rotate_half RoPE on queries and keys, key/value heads
repeated for their query heads, causal SDPA."""

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaStyleAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, n_kv_heads=2, base=10000.0, max_len=64):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        inv_freq = 1.0 / base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos_cached[:n], self.sin_cached[:n]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.n_heads // self.n_kv_heads
        k = k[:, :, None].expand(b, self.n_kv_heads, group, n, self.head_dim)
        v = v[:, :, None].expand(b, self.n_kv_heads, group, n, self.head_dim)
        k = k.reshape(b, self.n_heads, n, self.head_dim)
        v = v.reshape(b, self.n_heads, n, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {
    "target": "LlamaStyleAttention",
    "kind": "causal-multihead",
    "ok": True,
    "init": {"d_model": 32, "n_heads": 4, "n_kv_heads": 2},
}
