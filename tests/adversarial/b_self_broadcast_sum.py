"""Self-attention computing the context by broadcasting and pairing the wrong axes (sums over queries)."""

import torch
import torch.nn as nn


class BroadcastContext(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        w = torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1)  # (b, q, k)
        return (w.unsqueeze(-1) * v.unsqueeze(-2)).sum(-3)  # meant v.unsqueeze(-3) and .sum(-2)


EXPECT = {
    "target": "BroadcastContext",
    "kind": "self",
    "ok": False,
    "stage": "context",
    "mistake": "context_wrong_product",
}
