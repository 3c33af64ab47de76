"""Self-attention with biased projections, but the values go through F.linear without the bias."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class BiasedSelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=True)
        self.W_key = nn.Linear(d_in, d_out, bias=True)
        self.W_value = nn.Linear(d_in, d_out, bias=True)

    def forward(self, x):
        q = F.linear(x, self.W_query.weight, self.W_query.bias)
        k = F.linear(x, self.W_key.weight, self.W_key.bias)
        v = F.linear(x, self.W_value.weight)
        w = torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1)
        return w @ v


EXPECT = {
    "target": "BiasedSelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "values",
    "mistake": "wrong_projection",
}
