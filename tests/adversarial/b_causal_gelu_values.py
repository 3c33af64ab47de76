"""Causal attention that passes the value vectors through GELU before mixing them."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class GeluValuesCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))

    def forward(self, x):
        t = x.shape[1]
        q = self.W_query(x)
        k = self.W_key(x)
        v = F.gelu(self.W_value(x))
        s = (q @ k.transpose(1, 2)) / k.shape[-1] ** 0.5
        s = s.masked_fill(self.mask[:t, :t].bool(), -torch.inf)
        return torch.softmax(s, -1) @ v


EXPECT = {
    "target": "GeluValuesCausal",
    "kind": "causal",
    "ok": False,
    "stage": "values",
    "mistake": "other",
}
