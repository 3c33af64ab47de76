"""Scale folded into the queries (fine) plus F.softmax over dim=1, the query axis of (b, q, k)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class ScaledQuerySelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.scale = d_out**-0.5

    def forward(self, x):
        q = self.query(x) * self.scale
        k = self.key(x)
        v = self.value(x)
        weights = F.softmax(torch.bmm(q, k.transpose(1, 2)), dim=1)
        return torch.bmm(weights, v)


EXPECT = {
    "target": "ScaledQuerySelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
}
