"""Causal attention computed internally in float64, masked with torch.where(keep, s, -inf)."""

import math

import torch
import torch.nn as nn


class Float64CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer(
            "keep", torch.ones(context_length, context_length, dtype=torch.bool).tril()
        )

    def forward(self, x):
        dtype = x.dtype
        x64 = x.double()
        q = x64 @ self.W_query.weight.double().T
        k = x64 @ self.W_key.weight.double().T
        v = x64 @ self.W_value.weight.double().T
        n = x.shape[-2]
        s = (q @ k.mT) / math.sqrt(k.shape[-1])
        s = torch.where(self.keep[:n, :n], s, torch.tensor(float("-inf"), dtype=s.dtype))
        w = torch.softmax(s, dim=-1)
        return (w @ v).to(dtype)


EXPECT = {"target": "Float64CausalAttention", "kind": "causal", "ok": True}
