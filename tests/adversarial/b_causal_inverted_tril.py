"""Causal attention with an inverted keep-mask: torch.where(tril == 0, s, -inf) keeps only the future."""

import torch
import torch.nn as nn


class InvertedTrilCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = q @ k.transpose(1, 2) * k.shape[-1] ** -0.5
        s = torch.where(self.tril[:T, :T] == 0, s, torch.finfo(s.dtype).min)
        return torch.softmax(s, dim=-1) @ v


EXPECT = {
    "target": "InvertedTrilCausal",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
}
