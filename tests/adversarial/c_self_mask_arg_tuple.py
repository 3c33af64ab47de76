"""Self-attention with forward(x, mask=None) returning (out, attn, None) like some HF layers."""

import torch
import torch.nn as nn


class TupleSelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.query = nn.Linear(d_in, d_out)
        self.key = nn.Linear(d_in, d_out)
        self.value = nn.Linear(d_in, d_out)
        self.scale = d_out**-0.5

    def forward(self, x, mask=None, past_key_value=None):
        q = self.query(x)
        k = self.key(x)
        v = self.value(x)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if mask is not None:
            scores = scores + mask
        attn = nn.functional.softmax(scores, dim=-1)
        out = torch.matmul(attn, v)
        return out, attn, None


EXPECT = {"target": "TupleSelfAttention", "kind": "self", "ok": True}
