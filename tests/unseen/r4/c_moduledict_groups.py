"""Hand-rolled attention keeping its projections in an nn.ModuleDict ('q', 'k', 'v', 'o') and its head count as self.groups."""

import math

import torch
import torch.nn as nn


class DictAttention(nn.Module):
    def __init__(self, dim, heads=3, bias=True):
        super().__init__()
        self.groups = heads
        self.width = dim // heads
        self.proj = nn.ModuleDict(
            {name: nn.Linear(dim, dim, bias=bias) for name in ("q", "k", "v", "o")}
        )

    def _fold(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.groups, self.width).permute(0, 2, 1, 3)

    def forward(self, x, attention_mask=None):
        q = self._fold(self.proj["q"](x))
        k = self._fold(self.proj["k"](x))
        v = self._fold(self.proj["v"](x))
        logits = torch.einsum("bgid,bgjd->bgij", q, k) / math.sqrt(self.width)
        if attention_mask is not None:
            logits = logits.masked_fill(~attention_mask, float("-inf"))
        probs = logits.softmax(-1)
        mixed = torch.einsum("bgij,bgjd->bgid", probs, v)
        b, _, n, _ = mixed.shape
        mixed = mixed.permute(0, 2, 1, 3).reshape(b, n, self.groups * self.width)
        return self.proj["o"](mixed)


EXPECT = {
    "target": "DictAttention",
    "kind": "multihead",
    "ok": True,
    "style": "nn.ModuleDict projections, heads stored as self.groups",
}
