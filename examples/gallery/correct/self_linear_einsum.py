"""Self-attention with nn.Linear and einsum; accepts (tokens, d_in) or (batch, tokens, d_in)."""

import torch
import torch.nn as nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        q = self.W_query(x)
        k = self.W_key(x)
        v = self.W_value(x)
        scores = torch.einsum("...qd,...kd->...qk", q, k) / k.shape[-1] ** 0.5
        weights = torch.softmax(scores, dim=-1)
        return torch.einsum("...qk,...kd->...qd", weights, v)


EXPECT = {"target": "SelfAttention", "kind": "self", "ok": True}
