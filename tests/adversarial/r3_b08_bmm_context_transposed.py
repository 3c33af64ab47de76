"""Causal attention computing the context as torch.bmm(v.transpose(1, 2), w).transpose(1, 2) (= w^T v)."""

import torch
import torch.nn as nn


class BmmCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1).bool()
        )

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = torch.bmm(q, k.transpose(1, 2)) / k.shape[-1] ** 0.5
        s = s.masked_fill(self.mask[:t, :t], float("-inf"))
        w = torch.softmax(s, dim=-1)
        ctx = torch.bmm(v.transpose(1, 2), w)  # (b, d, t)
        return ctx.transpose(1, 2)


EXPECT = {
    "target": "BmmCausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "context",
    "mistake": "context_wrong_product",
}
