"""Causal attention scaling by sqrt of the number of tokens (x.shape[1]) instead of sqrt(d_k)."""

import math

import torch
import torch.nn as nn


class TokenScaledCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))

    def forward(self, x):
        b, num_tokens, d = x.shape
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = q @ k.transpose(1, 2)
        s = s / math.sqrt(num_tokens)
        s = s.masked_fill(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        return torch.softmax(s, dim=-1) @ v


EXPECT = {
    "target": "TokenScaledCausal",
    "kind": "causal",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
}
