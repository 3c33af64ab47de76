"""Self-attention with raw (d_out, d_in) weight and bias parameters applied through F.linear."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class LinearWeightsAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.w_q = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.w_k = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.w_v = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.b_q = nn.Parameter(torch.randn(d_out) * 0.3)
        self.b_k = nn.Parameter(torch.randn(d_out) * 0.3)
        self.b_v = nn.Parameter(torch.randn(d_out) * 0.3)

    def forward(self, x):
        q = F.linear(x, self.w_q, self.b_q)
        k = F.linear(x, self.w_k, self.b_k)
        v = F.linear(x, self.w_v, self.b_v)
        scores = torch.matmul(q, k.transpose(-2, -1)) / k.size(-1) ** 0.5
        return torch.matmul(scores.softmax(dim=-1), v)


EXPECT = {"target": "LinearWeightsAttention", "kind": "self", "ok": True}
