"""Multi-head attention that uses F.log_softmax where F.softmax was meant."""

import torch.nn as nn
import torch.nn.functional as F


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
        att = F.log_softmax(xq @ xk.transpose(2, 3) / self.hd**0.5, dim=-1)
        y = (att @ xv).transpose(1, 2).reshape(B, T, -1)
        return self.wo(y)


EXPECT = {
    "target": "MHSelfAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
}
