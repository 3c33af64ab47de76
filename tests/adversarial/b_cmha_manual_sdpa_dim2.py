"""Causal MHA with a hand-written sdpa() helper whose softmax runs over dim=-2."""

import math

import torch
import torch.nn as nn


def sdpa(q, k, v, is_causal=False):
    L, S = q.size(-2), k.size(-2)
    attn = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.size(-1)))
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        attn = attn.masked_fill(keep.logical_not(), float("-inf"))
    attn = torch.softmax(attn, dim=-2)
    return attn @ v


class ManualSDPAMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        b, t, _ = x.shape
        f = lambda z: z.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        y = sdpa(f(self.W_query(x)), f(self.W_key(x)), f(self.W_value(x)), is_causal=True)
        return self.out_proj(y.transpose(1, 2).flatten(2))


EXPECT = {
    "target": "ManualSDPAMHA",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
}
