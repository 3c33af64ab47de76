"""Causal head applying the mask multiplicatively (logits * tril)."""

import torch
import torch.nn as nn


class MaskedHead(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=False)
        self.k = nn.Linear(d_in, d_out, bias=False)
        self.v = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("lower", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, h):
        T = h.shape[1]
        Q, K, V = self.q(h), self.k(h), self.v(h)
        logits = Q @ K.transpose(1, 2) / K.shape[-1] ** 0.5
        logits = logits * self.lower[:T, :T]
        return logits.softmax(-1) @ V


EXPECT = {
    "target": "MaskedHead",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
}
