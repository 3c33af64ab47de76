"""Multi-head attention adding the (merged) queries back onto the context before out_proj."""

import torch
import torch.nn as nn


class QueryResidualMHA(nn.Module):
    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        self.h = num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        b, t, _ = x.shape
        qf = self.W_query(x)
        sp = lambda z: z.view(b, t, self.h, -1).transpose(1, 2)
        q, k, v = sp(qf), sp(self.W_key(x)), sp(self.W_value(x))
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        ctx = (w @ v).transpose(1, 2).reshape(b, t, -1)
        return self.out_proj(ctx + qf)


EXPECT = {
    "target": "QueryResidualMHA",
    "kind": "multihead",
    "ok": False,
    "stage": "output",
    "mistake": "other",
}
