"""Self-attention folding 1/sqrt(d_k) into the queries, torch.bmm, biases; batched only."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class ScaledQuerySelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=True):
        super().__init__()
        self.query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.scale = d_out**-0.5

    def forward(self, x):
        q = self.query(x) * self.scale
        k = self.key(x)
        v = self.value(x)
        weights = F.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
        return torch.bmm(weights, v)


EXPECT = {"target": "ScaledQuerySelfAttention", "kind": "self", "ok": True}
