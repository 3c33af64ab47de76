"""Causal MHA merging heads with permute(0, 2, 3, 1) (features ordered (hd, h)) before out_proj."""

import torch
import torch.nn as nn


class PermuteMergeMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, t, _ = x.shape
        sp = lambda z: z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        q, k, v = sp(self.W_query(x)), sp(self.W_key(x)), sp(self.W_value(x))
        s = q @ k.transpose(2, 3)
        s.masked_fill_(self.mask.bool()[:t, :t], -torch.inf)
        w = torch.softmax(s / self.head_dim**0.5, dim=-1)
        ctx = (w @ v).permute(0, 2, 3, 1).reshape(b, t, self.d_out)
        return self.out_proj(ctx)


EXPECT = {
    "target": "PermuteMergeMHA",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "output",
    "mistake": "heads_merge",
}
