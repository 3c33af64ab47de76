"""Self-attention that projects the keys straight into their transposed (d_out, tokens) layout."""

import torch
import torch.nn as nn


class KeysTSelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=False)
        self.k = nn.Linear(d_in, d_out, bias=False)
        self.v = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        queries = self.q(x)
        keys_t = self.k.weight @ x.transpose(-2, -1)  # (.., d_out, tokens)
        values = self.v(x)
        scores = queries @ keys_t
        weights = torch.softmax(scores * keys_t.shape[-2] ** -0.5, dim=-1)
        return weights @ values


EXPECT = {"target": "KeysTSelfAttention", "kind": "self", "ok": True}
