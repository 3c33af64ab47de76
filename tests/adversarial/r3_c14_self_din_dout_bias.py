"""Self-attention with d_in != d_out and biases on every projection; batched or unbatched."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BiasedSelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.query = nn.Linear(d_in, d_out, bias=True)
        self.key = nn.Linear(d_in, d_out, bias=True)
        self.value = nn.Linear(d_in, d_out, bias=True)
        self.d_out = d_out

    def forward(self, x):
        q = self.query(x)
        k = self.key(x)
        v = self.value(x)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_out)
        weights = F.softmax(scores, dim=-1)
        return torch.matmul(weights, v)


EXPECT = {"target": "BiasedSelfAttention", "kind": "self", "ok": True}
