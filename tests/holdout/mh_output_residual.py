"""Multi-head attention that adds the merged heads back onto the projected output (proj(y) + y)."""

import torch
import torch.nn as nn


class MHSelfAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.hd = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, h):
        B, T, _ = h.shape
        xq = self.wq(h).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        xk = self.wk(h).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        xv = self.wv(h).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        att = torch.softmax(xq @ xk.transpose(2, 3) / self.hd**0.5, dim=-1)
        y = (att @ xv).transpose(1, 2).reshape(B, T, -1)
        return self.wo(y) + y


EXPECT = {
    "target": "MHSelfAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "output",
    "mistake": "other",
}
