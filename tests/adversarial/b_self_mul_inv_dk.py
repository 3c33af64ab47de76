"""Self-attention scaling scores by dk**-1 (meant dk**-0.5)."""

import torch
import torch.nn as nn


class InvDkAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        dk = q.shape[-1]
        scores = torch.matmul(q, k.mT) * dk**-1
        return torch.matmul(scores.softmax(dim=-1), v)


EXPECT = {
    "target": "InvDkAttention",
    "kind": "self",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
}
