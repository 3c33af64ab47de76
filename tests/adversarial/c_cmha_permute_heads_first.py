"""Causal MHA that puts heads before batch: reshape(b,t,h,hd).permute(2,0,1,3), torch.where mask."""

import torch
import torch.nn as nn


class HeadsOuterCausalMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.h = num_heads
        self.d_out = d_out
        self.Wqkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.register_buffer(
            "allowed", torch.tril(torch.ones(context_length, context_length)).bool()
        )

    def forward(self, x):
        b, t, _ = x.shape
        hd = self.d_out // self.h
        q, k, v = self.Wqkv(x).tensor_split(3, dim=-1)
        q = q.reshape(b, t, self.h, hd).permute(2, 0, 1, 3)  # (h, b, t, hd)
        k = k.reshape(b, t, self.h, hd).permute(2, 0, 3, 1)  # (h, b, hd, t)
        v = v.reshape(b, t, self.h, hd).permute(2, 0, 1, 3)
        s = torch.matmul(q, k) / hd**0.5
        s = torch.where(self.allowed[:t, :t], s, float("-inf"))
        ctx = torch.matmul(s.softmax(-1), v)  # (h, b, t, hd)
        ctx = ctx.permute(1, 2, 0, 3).reshape(b, t, self.d_out)
        return self.proj(ctx)


EXPECT = {"target": "HeadsOuterCausalMHA", "kind": "causal-multihead", "ok": True}
