"""Causal attention calling F.dropout(weights, 0.1) without training=..., so it drops in eval too."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class AlwaysDropCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.1):
        super().__init__()
        self.p = dropout
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), 1).bool()
        )

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = (q @ k.transpose(1, 2)) / k.shape[-1] ** 0.5
        s = s.masked_fill(self.mask[:t, :t], float("-inf"))
        w = F.dropout(torch.softmax(s, -1), 0.1)
        return w @ v


EXPECT = {
    "target": "AlwaysDropCausal",
    "kind": "causal",
    "ok": False,
    "stage": "weights",
    "mistake": "other",
}
