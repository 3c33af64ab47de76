"""Self-attention returning a dict {"out": context, "attn": weights}."""

import torch
import torch.nn as nn


class DictSelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        attn = torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1)
        return {"out": attn @ v, "attn": attn}


EXPECT = {"target": "DictSelfAttention", "kind": "self", "ok": True}
