"""Multi-head attention that splits heads as view(b, t, hd, h) (interleaved features), merged back consistently."""

import torch
import torch.nn as nn


class InterleavedMHA(nn.Module):
    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        self.h = num_heads
        self.hd = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)

    def _split(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.hd, self.h).permute(0, 3, 1, 2)  # (b, h, n, hd)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (
            self._split(self.W_query(x)),
            self._split(self.W_key(x)),
            self._split(self.W_value(x)),
        )
        w = torch.softmax(q @ k.transpose(-1, -2) / self.hd**0.5, dim=-1)
        ctx = (w @ v).permute(0, 2, 3, 1).reshape(b, n, -1)  # inverse of _split
        return self.out_proj(ctx)


EXPECT = {
    "target": "InterleavedMHA",
    "kind": "multihead",
    "ok": False,
    "stage": "queries",
    "mistake": "heads_split",
}
