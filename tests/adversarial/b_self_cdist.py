"""Self-attention scoring by negative squared Euclidean distance (torch.cdist) instead of q.k."""

import torch
import torch.nn as nn


class DistanceAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        scores = -(torch.cdist(q, k) ** 2)
        w = torch.softmax(scores / k.shape[-1] ** 0.5, dim=-1)
        return w @ v


EXPECT = {
    "target": "DistanceAttention",
    "kind": "self",
    "ok": False,
    "stage": "scores",
    "mistake": "not_dot_product",
}
