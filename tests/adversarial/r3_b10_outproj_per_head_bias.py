"""Multi-head attention applying out_proj per head with a weight column slice, adding the bias once per head."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class PerHeadProjMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, t, _ = x.shape
        split = lambda z: z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        ctx = torch.softmax(s / self.head_dim**0.5, dim=-1) @ v  # (b, h, t, hd)
        out = 0
        for h in range(self.num_heads):
            cols = slice(h * self.head_dim, (h + 1) * self.head_dim)
            out = out + F.linear(ctx[:, h], self.out_proj.weight[:, cols], self.out_proj.bias)
        return out


EXPECT = {
    "target": "PerHeadProjMHA",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "output",
    "mistake": "other",
}
