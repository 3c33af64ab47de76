"""Causal attention that upcasts queries/keys/values to float64 internally and casts back."""

import torch
import torch.nn as nn


class PreciseCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1).bool()
        )

    def forward(self, x):
        in_dtype = x.dtype
        q = self.W_query(x).to(torch.float64)
        k = self.W_key(x).to(torch.float64)
        v = self.W_value(x).double()
        n = x.shape[-2]
        scores = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5
        scores = scores.masked_fill(self.mask[:n, :n], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return (weights @ v).to(in_dtype)


EXPECT = {"target": "PreciseCausalAttention", "kind": "causal", "ok": True}
