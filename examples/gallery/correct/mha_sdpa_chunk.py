"""Causal multi-head attention: fused qkv .chunk(3, dim=-1), SDPA with is_causal=True."""

import torch.nn as nn
import torch.nn.functional as F


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = dropout

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.W_qkv(x).chunk(3, dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        ctx = ctx.transpose(1, 2).contiguous().view(b, t, self.d_out)
        return self.out_proj(ctx)


EXPECT = {"target": "MultiHeadAttention", "kind": "causal-multihead", "ok": True}
