"""Causal head with a hand-written max-subtracted softmax and a per-call -inf triu mask."""

import torch
import torch.nn as nn


class MaskedHead(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=False)
        self.k = nn.Linear(d_in, d_out, bias=False)
        self.v = nn.Linear(d_in, d_out, bias=False)

    def forward(self, h):
        T = h.size(-2)
        Q, K, V = self.q(h), self.k(h), self.v(h)
        logits = Q @ K.transpose(-1, -2) / K.size(-1) ** 0.5
        hide = torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1)
        logits = logits.masked_fill(hide, float("-inf"))
        logits = logits - logits.amax(dim=-1, keepdim=True)
        e = logits.exp()
        P = e / e.sum(dim=-1, keepdim=True)
        return P @ V


EXPECT = {"target": "MaskedHead", "kind": "causal", "ok": True}
