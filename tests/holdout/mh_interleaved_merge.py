"""Causal multi-head attention merging heads with permute(0, 2, 3, 1)."""

import torch
import torch.nn as nn


class CausalMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.h = num_heads
        self.dh = d_out // num_heads
        self.to_q = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.to_k = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.to_v = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.register_buffer("hide", torch.ones(context_length, context_length).triu(1).bool())

    def forward(self, h):
        B, T, _ = h.shape
        Q = self.to_q(h).reshape(B, T, self.h, self.dh).permute(0, 2, 1, 3)
        K = self.to_k(h).reshape(B, T, self.h, self.dh).permute(0, 2, 1, 3)
        V = self.to_v(h).reshape(B, T, self.h, self.dh).permute(0, 2, 1, 3)
        logits = Q @ K.transpose(-1, -2) / self.dh**0.5
        P = logits.masked_fill(self.hide[:T, :T], float("-inf")).softmax(-1)
        Y = (P @ V).permute(0, 2, 3, 1).reshape(B, T, -1)
        return self.proj(Y)


EXPECT = {
    "target": "CausalMHA",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "output",
    "mistake": "heads_merge",
}
