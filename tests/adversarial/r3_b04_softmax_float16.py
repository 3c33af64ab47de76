"""Causal attention that computes the softmax in float16 ("to save memory") and casts back."""

import torch
import torch.nn as nn


class HalfSoftmaxCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        n = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        scores = q @ k.transpose(1, 2)
        scores = scores.masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        weights = torch.softmax((scores / k.shape[-1] ** 0.5).half(), dim=-1).to(x.dtype)
        return weights @ v


EXPECT = {
    "target": "HalfSoftmaxCausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "weights",
    "mistake": "other",
}
