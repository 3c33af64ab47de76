"""Multi-head attention: fused qkv Linear laid out (q, k, v), unpacked as keys, queries, values."""

import torch
import torch.nn as nn


class FusedMultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.d_out = d_out
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, t, _ = x.shape
        keys, queries, values = self.qkv(x).chunk(3, dim=-1)
        queries = queries.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        attn_scores = queries @ keys.transpose(-2, -1) / self.head_dim**0.5
        attn_weights = torch.softmax(attn_scores, dim=-1)
        context = (self.dropout(attn_weights) @ values).transpose(1, 2).reshape(b, t, self.d_out)
        return self.out_proj(context)


EXPECT = {
    "target": "FusedMultiHeadAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "queries",
    "mistake": "wrong_projection",
}
