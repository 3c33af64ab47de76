"""Causal attention: fused qkv Linear, .split(d_out), scaled_dot_product_attention(is_causal)."""

import torch.nn as nn
import torch.nn.functional as F


class FusedCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.dropout = dropout

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.d_out, dim=-1)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


EXPECT = {"target": "FusedCausalAttention", "kind": "causal", "ok": True}
