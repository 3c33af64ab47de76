"""Causal head with a torch.where -inf mask on the raw logits and no 1/sqrt(d_k) anywhere."""

import torch
import torch.nn as nn


class MaskedHead(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=False)
        self.k = nn.Linear(d_in, d_out, bias=False)
        self.v = nn.Linear(d_in, d_out, bias=False)
        visible = torch.tril(torch.ones(context_length, context_length, dtype=torch.bool))
        self.register_buffer("visible", visible)

    def forward(self, h):
        T = h.shape[-2]
        Q, K, V = self.q(h), self.k(h), self.v(h)
        logits = torch.where(self.visible[:T, :T], Q @ K.transpose(-1, -2), float("-inf"))
        return torch.softmax(logits, dim=-1) @ V


EXPECT = {
    "target": "MaskedHead",
    "kind": "causal",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "missing_scale",
}
