"""Causal head with keep-mask tril(diagonal=-1) and a -1e9 fill."""

import torch
import torch.nn as nn


class MaskedHead(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=False)
        self.k = nn.Linear(d_in, d_out, bias=False)
        self.v = nn.Linear(d_in, d_out, bias=False)
        keep = torch.tril(torch.ones(context_length, context_length), diagonal=-1)
        self.register_buffer("keep", keep)

    def forward(self, h):
        T = h.shape[-2]
        Q, K, V = self.q(h), self.k(h), self.v(h)
        logits = Q @ K.transpose(-1, -2) / K.shape[-1] ** 0.5
        logits = logits.masked_fill(self.keep[:T, :T] == 0, -1e9)
        return logits.softmax(dim=-1) @ V


EXPECT = {
    "target": "MaskedHead",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
}
