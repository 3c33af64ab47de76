"""Causal multi-head attention from per-head q/k/v Linear lists, concatenated, then projected."""

import torch
import torch.nn as nn


class HeadListAttention(nn.Module):
    def __init__(self, d_model, n_heads, max_len):
        super().__init__()
        d_head = d_model // n_heads
        self.qs = nn.ModuleList(nn.Linear(d_model, d_head) for _ in range(n_heads))
        self.ks = nn.ModuleList(nn.Linear(d_model, d_head) for _ in range(n_heads))
        self.vs = nn.ModuleList(nn.Linear(d_model, d_head) for _ in range(n_heads))
        self.o = nn.Linear(d_model, d_model)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

    def forward(self, h):
        T = h.shape[1]
        outs = []
        for fq, fk, fv in zip(self.qs, self.ks, self.vs, strict=True):
            Q, K, V = fq(h), fk(h), fv(h)
            logits = Q @ K.transpose(1, 2) / K.shape[-1] ** 0.5
            logits = torch.where(self.causal[:T, :T], logits, float("-inf"))
            outs.append(logits.softmax(dim=-1) @ V)
        return self.o(torch.cat(outs, dim=-1))


EXPECT = {
    "target": "HeadListAttention",
    "kind": "causal-multihead",
    "ok": True,
    "init": {"d_model": 8, "n_heads": 2, "max_len": 16},
}
