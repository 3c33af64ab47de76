"""Multi-head attention passing scale=1/sqrt(head_dim) explicitly to scaled_dot_product_attention."""

import math

import torch.nn as nn
import torch.nn.functional as F


class SDPAMultiHead(nn.Module):
    def __init__(self, d_in, d_out, num_heads, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.q_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.k_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.v_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.o_proj = nn.Linear(d_out, d_out)

    def _shape(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (
            self._shape(self.q_proj(x)),
            self._shape(self.k_proj(x)),
            self._shape(self.v_proj(x)),
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {"target": "SDPAMultiHead", "kind": "multihead", "ok": True}
