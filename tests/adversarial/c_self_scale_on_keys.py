"""Self-attention that folds 1/sqrt(d_k) into the keys instead of the queries."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class KeyScaledAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_q = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_k = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_v = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        q = self.W_q(x)
        k = self.W_k(x) / math.sqrt(q.size(-1))
        v = self.W_v(x)
        attn = F.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
        return torch.matmul(attn, v)


EXPECT = {"target": "KeyScaledAttention", "kind": "self", "ok": True}
