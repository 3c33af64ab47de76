"""Single head that layer-normalises the context vectors before returning them."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.to_q = nn.Linear(d_in, d_out, bias=False)
        self.to_k = nn.Linear(d_in, d_out, bias=False)
        self.to_v = nn.Linear(d_in, d_out, bias=False)

    def forward(self, tokens):
        Q, K, V = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        A = torch.softmax(Q @ K.transpose(-1, -2) / K.shape[-1] ** 0.5, dim=-1)
        ctx = A @ V
        return F.layer_norm(ctx, ctx.shape[-1:])


EXPECT = {"target": "Head", "kind": "self", "ok": False, "stage": "context", "mistake": "other"}
