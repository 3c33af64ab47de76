"""Self-attention with an einsum typo: 'bqd,ckd->bqk' sums the keys over the whole batch."""

import torch
import torch.nn as nn


class EinsumTypoAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = torch.einsum("bqd,ckd->bqk", q, k) / k.shape[-1] ** 0.5
        return torch.einsum("bqk,bkd->bqd", s.softmax(-1), v)


EXPECT = {
    "target": "EinsumTypoAttention",
    "kind": "self",
    "ok": False,
    "stage": "scores",
    "mistake": "batch_mixing",
}
