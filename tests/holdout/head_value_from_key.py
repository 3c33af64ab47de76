"""Single head whose values come out of the key projection."""

import torch
import torch.nn as nn


class Head(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.to_q = nn.Linear(d_in, d_out, bias=False)
        self.to_k = nn.Linear(d_in, d_out, bias=False)
        self.to_v = nn.Linear(d_in, d_out, bias=False)

    def forward(self, tokens):
        Q = self.to_q(tokens)
        K = self.to_k(tokens)
        V = self.to_k(tokens)
        A = torch.softmax(Q @ K.transpose(-1, -2) / K.shape[-1] ** 0.5, dim=-1)
        return A @ V


EXPECT = {
    "target": "Head",
    "kind": "self",
    "ok": False,
    "stage": "values",
    "mistake": "wrong_projection",
}
