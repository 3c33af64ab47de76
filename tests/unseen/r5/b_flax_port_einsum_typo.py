"""Flax-to-PyTorch port with '...qhd,...khd->...hqk' einsums and heads fixed by a reshape literal; bug: the key head letter differs, so scores sum over every key head."""

import math

import torch
from torch import nn


class DotProductSelfAttention(nn.Module):
    """Port of a flax.linen MultiHeadDotProductAttention (4 heads, hard-coded as in the original config)."""

    def __init__(self, d_model, bias=True):
        super().__init__()
        self.query = nn.Linear(d_model, d_model, bias=bias)
        self.key = nn.Linear(d_model, d_model, bias=bias)
        self.value = nn.Linear(d_model, d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, inputs_q):
        b, length, features = inputs_q.shape
        # [batch, length, heads, head_dim]
        query = self.query(inputs_q).reshape(b, length, 4, -1)
        key = self.key(inputs_q).reshape(b, length, 4, -1)
        value = self.value(inputs_q).reshape(b, length, 4, -1)
        depth = query.shape[-1]

        query = query / math.sqrt(depth)
        attn_weights = torch.einsum("...qhd,...kgd->...hqk", query, key)
        attn_weights = torch.softmax(attn_weights, dim=-1)
        x = torch.einsum("...hqk,...khd->...qhd", attn_weights, value)
        return self.out(x.reshape(b, length, features))


def make_attention():
    return DotProductSelfAttention(d_model=20)


EXPECT = {
    "target": "make_attention",
    "kind": "multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "not_dot_product",
    "style": "Flax MultiHeadDotProductAttention port (einsum '...qhd,...kgd->...hqk' typo sums over key heads; heads as literal 4)",
}
