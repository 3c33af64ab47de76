"""Causal attention using F.dropout(p, training=self.training) and a hard-coded dropout rate."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FDropoutCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.p = 0.1
        self.qkv = nn.ModuleDict(
            {n: nn.Linear(d_in, d_out, bias=False) for n in ("query", "key", "value")}
        )
        self.register_buffer("tri", torch.tril(torch.ones(context_length, context_length)).bool())

    def forward(self, x):
        q = self.qkv["query"](x)
        k = self.qkv["key"](x)
        v = self.qkv["value"](x)
        t = x.shape[1]
        att = q @ k.transpose(1, 2) / (k.shape[-1] ** 0.5)
        att = att.masked_fill(~self.tri[:t, :t], float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), p=self.p, training=self.training)
        return att @ v


EXPECT = {"target": "FDropoutCausal", "kind": "causal", "ok": True}
