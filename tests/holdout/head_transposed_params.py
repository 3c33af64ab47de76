"""Single head with xavier-initialised (d_out, d_in) parameters used as x @ W.T and torch.matmul."""

import torch
import torch.nn as nn


class Head(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.Wq = nn.Parameter(torch.empty(d_out, d_in))
        self.Wk = nn.Parameter(torch.empty(d_out, d_in))
        self.Wv = nn.Parameter(torch.empty(d_out, d_in))
        for w in (self.Wq, self.Wk, self.Wv):
            nn.init.xavier_uniform_(w)

    def forward(self, tokens):
        Q = tokens @ self.Wq.T
        K = tokens @ self.Wk.T
        V = tokens @ self.Wv.T
        logits = torch.matmul(Q, K.transpose(-1, -2)) * K.size(-1) ** -0.5
        return torch.matmul(logits.softmax(-1), V)


EXPECT = {"target": "Head", "kind": "self", "ok": True}
