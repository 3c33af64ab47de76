"""Llama-flavoured non-causal multi-head attention: wq/wk/wv/wo, dim/n_heads, fp32 softmax."""

import torch
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
        bsz, seqlen, _ = h.shape
        xq = self.wq(h).view(bsz, seqlen, self.n_heads, self.hd).transpose(1, 2)
        xk = self.wk(h).view(bsz, seqlen, self.n_heads, self.hd).transpose(1, 2)
        xv = self.wv(h).view(bsz, seqlen, self.n_heads, self.hd).transpose(1, 2)
        att = torch.matmul(xq, xk.transpose(2, 3)) / self.hd**0.5
        att = F.softmax(att.float(), dim=-1).type_as(xq)
        out = torch.matmul(att, xv)
        out = out.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


EXPECT = {"target": "MHSelfAttention", "kind": "multihead", "ok": True}
