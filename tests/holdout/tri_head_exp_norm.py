"""Causal head with an inline exp / sum normalisation after a torch.where -inf mask."""

import torch
import torch.nn as nn


class MaskedHead(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=False)
        self.k = nn.Linear(d_in, d_out, bias=False)
        self.v = nn.Linear(d_in, d_out, bias=False)

    def forward(self, h):
        T = h.shape[-2]
        Q, K, V = self.q(h), self.k(h), self.v(h)
        logits = Q @ K.transpose(-1, -2) / K.shape[-1] ** 0.5
        visible = torch.tril(torch.ones(T, T, dtype=torch.bool, device=h.device))
        logits = torch.where(visible, logits, float("-inf"))
        e = logits.exp()
        return (e / e.sum(dim=-1, keepdim=True)) @ V


EXPECT = {
    "target": "MaskedHead",
    "kind": "causal",
    "ok": False,
    "stage": "weights",
    "mistake": "unstable_softmax",
}
