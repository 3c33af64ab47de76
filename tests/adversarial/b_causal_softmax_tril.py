"""Causal attention that applies .tril() to the softmax output (no renormalisation)."""

import torch
import torch.nn as nn


class TrilWeightsCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        w = torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1).tril()
        return self.dropout(w) @ v


EXPECT = {
    "target": "TrilWeightsCausal",
    "kind": "causal",
    "ok": False,
    "stage": "weights",
    "mistake": "mask_after_softmax",
}
