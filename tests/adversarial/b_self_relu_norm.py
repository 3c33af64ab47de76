"""Self-attention with 'ReLU attention': relu(scores) normalised by their row sum."""

import torch.nn as nn
import torch.nn.functional as F


class ReluNormAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out)
        self.W_key = nn.Linear(d_in, d_out)
        self.W_value = nn.Linear(d_in, d_out)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5
        w = F.relu(s)
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-9)
        return w @ v


EXPECT = {
    "target": "ReluNormAttention",
    "kind": "self",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
}
