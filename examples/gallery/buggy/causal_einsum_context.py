"""Causal einsum attention: right scores and mask, but the context einsum sums over queries."""

import torch
import torch.nn as nn


class EinsumCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        mask = torch.ones(context_length, context_length, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        t = x.shape[1]
        q = self.W_query(x)
        k = self.W_key(x)
        v = self.W_value(x)
        scores = torch.einsum("bqd,bkd->bqk", q, k) / k.shape[-1] ** 0.5
        scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
        weights = scores.softmax(dim=-1)
        return torch.einsum("bqk,bqd->bkd", weights, v)


EXPECT = {
    "target": "EinsumCausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "context",
    "mistake": "context_wrong_product",
}
