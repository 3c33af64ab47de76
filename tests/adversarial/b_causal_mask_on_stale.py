"""Causal attention that masks the raw scores in place AFTER the scaled copy was already taken."""

import torch
import torch.nn as nn


class StaleMaskCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        n = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        scores = q @ k.transpose(1, 2)
        scaled = scores / k.shape[-1] ** 0.5
        scores.masked_fill_(self.mask.bool()[:n, :n], -torch.inf)
        weights = torch.softmax(scaled, dim=-1)
        return weights @ v


EXPECT = {
    "target": "StaleMaskCausal",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "missing_mask",
}
