"""Causal attention: d_k**-0.25 on both q and k, additive torch.full(-inf).triu(1) mask."""

import torch
import torch.nn as nn


class SymScaledCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.query = nn.Linear(d_in, d_out, bias=False)
        self.key = nn.Linear(d_in, d_out, bias=False)
        self.value = nn.Linear(d_in, d_out, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        t = x.shape[-2]
        s = self.query.out_features**-0.25
        q = self.query(x) * s
        k = self.key(x) * s
        v = self.value(x)
        bias = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        att = (q @ k.transpose(-2, -1) + bias).softmax(dim=-1)
        return self.drop(att) @ v


EXPECT = {"target": "SymScaledCausal", "kind": "causal", "ok": True}
