"""Causal attention that only accepts a single (tokens, d_in) sequence and says so."""

import torch
import torch.nn as nn


class SingleSequenceCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.Wq = nn.Parameter(torch.rand(d_in, d_out))
        self.Wk = nn.Parameter(torch.rand(d_in, d_out))
        self.Wv = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        if x.dim() != 2:
            raise ValueError("expected a single sequence of shape (tokens, d_in)")
        q = torch.mm(x, self.Wq)
        k = torch.mm(x, self.Wk)
        v = torch.mm(x, self.Wv)
        s = torch.mm(q, k.t()) / self.Wk.shape[1] ** 0.5
        n = x.shape[0]
        s = s.masked_fill(torch.ones(n, n).triu(1).bool(), -float("inf"))
        return torch.mm(torch.softmax(s, 1), v)


EXPECT = {"target": "SingleSequenceCausal", "kind": "causal", "ok": True}
