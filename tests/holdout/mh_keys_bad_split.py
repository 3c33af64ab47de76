"""Multi-head attention reshaping only the keys straight to (B, heads, T, head_dim)."""

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
        xk = self.wk(h).reshape(B, self.n_heads, T, self.hd)
        xv = self.wv(h).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        att = (xq @ xk.transpose(2, 3)) / self.hd**0.5
        out = att.softmax(dim=-1) @ xv
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


EXPECT = {
    "target": "MHSelfAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "keys",
    "mistake": "heads_split",
}
