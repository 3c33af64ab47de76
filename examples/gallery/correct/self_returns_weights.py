"""Self-attention with torch.randn (d_in, d_out) parameters returning (context, weights)."""

import torch
import torch.nn as nn


class SelfAttentionWithWeights(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_q = nn.Parameter(torch.randn(d_in, d_out) * d_in**-0.5)
        self.W_k = nn.Parameter(torch.randn(d_in, d_out) * d_in**-0.5)
        self.W_v = nn.Parameter(torch.randn(d_in, d_out) * d_in**-0.5)

    def forward(self, x):
        q = x @ self.W_q
        k = x @ self.W_k
        v = x @ self.W_v
        d_k = k.shape[-1]
        attn = torch.softmax(q @ k.transpose(-2, -1) / d_k**0.5, dim=-1)
        return attn @ v, attn


EXPECT = {"target": "SelfAttentionWithWeights", "kind": "self", "ok": True}
