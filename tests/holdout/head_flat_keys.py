"""Single head flattening keys and values over the batch before attending."""

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
        K = self.to_k(tokens).reshape(-1, self.to_k.out_features)
        V = self.to_v(tokens).reshape(-1, self.to_v.out_features)
        A = torch.softmax(Q @ K.T / K.shape[-1] ** 0.5, dim=-1)
        return A @ V


EXPECT = {
    "target": "Head",
    "kind": "self",
    "ok": False,
    "stage": "scores",
    "mistake": "batch_mixing",
}
