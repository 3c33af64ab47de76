"""Queries rotated with the tables of the next position (a slice off by one), keys with
their own."""

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, max_len=64):
        super().__init__()
        self.h, self.hd = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        ang = torch.outer(torch.arange(max_len + 1).float(), inv)
        self.register_buffer(
            "cos", (lambda a: torch.cat((a, a), dim=-1))(ang).cos(), persistent=False
        )
        self.register_buffer(
            "sin", (lambda a: torch.cat((a, a), dim=-1))(ang).sin(), persistent=False
        )

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        q = q * self.cos[1 : n + 1] + rotate_half(q) * self.sin[1 : n + 1]  # bug: one ahead
        k = k * self.cos[:n] + rotate_half(k) * self.sin[:n]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {
    "target": "RotaryAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "init": {"d_model": 32, "n_heads": 4},
}
