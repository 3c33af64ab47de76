"""Single head that multiplies the logits by sqrt(d_k) (scale = d ** 0.5 used as a factor)."""

import torch.nn as nn


class Head(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.to_q = nn.Linear(d_in, d_out, bias=False)
        self.to_k = nn.Linear(d_in, d_out, bias=False)
        self.to_v = nn.Linear(d_in, d_out, bias=False)
        self.scale = d_out**0.5

    def forward(self, tokens):
        Q, K, V = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        logits = (Q @ K.transpose(-1, -2)) * self.scale
        return logits.softmax(dim=-1) @ V


EXPECT = {
    "target": "Head",
    "kind": "self",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
}
