"""Batched self-attention taking softmax over dim=1 of (batch, queries, keys)."""

import torch
import torch.nn as nn


class BatchedSelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = torch.bmm(queries, keys.transpose(1, 2))
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=1)
        return torch.bmm(attn_weights, values)


EXPECT = {
    "target": "BatchedSelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
}
