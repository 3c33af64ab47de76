"""DistilBERT-style MultiHeadSelfAttention: q_lin/k_lin/v_lin/out_lin, queries divided by sqrt(head size) before the product."""

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class DistilConfig:
    dim: int = 24
    n_heads: int = 4
    attention_dropout: float = 0.0


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, config: DistilConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.dim = config.dim
        if self.dim % self.n_heads != 0:
            raise ValueError(f"n_heads {self.n_heads} must divide dim {self.dim}")
        self.dropout = nn.Dropout(p=config.attention_dropout)

        self.q_lin = nn.Linear(config.dim, config.dim)
        self.k_lin = nn.Linear(config.dim, config.dim)
        self.v_lin = nn.Linear(config.dim, config.dim)
        self.out_lin = nn.Linear(config.dim, config.dim)

    def forward(self, query, key, value, mask=None, head_mask=None, output_attentions=False):
        bs, q_length, dim = query.size()
        k_length = key.size(1)
        dim_per_head = self.dim // self.n_heads

        def shape(t):
            # (bs, seq, dim) -> (bs, heads, seq, dim_per_head)
            return t.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        def unshape(t):
            # (bs, heads, seq, dim_per_head) -> (bs, seq, dim)
            return t.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

        q = shape(self.q_lin(query))
        k = shape(self.k_lin(key))
        v = shape(self.v_lin(value))

        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))  # (bs, heads, q_length, k_length)
        if mask is not None:
            hide = (mask == 0).view(bs, 1, 1, k_length).expand_as(scores)
            scores = scores.masked_fill(hide, torch.finfo(scores.dtype).min)

        weights = nn.functional.softmax(scores, dim=-1)
        weights = self.dropout(weights)
        if head_mask is not None:
            weights = weights * head_mask

        context = unshape(torch.matmul(weights, v))
        context = self.out_lin(context)
        if output_attentions:
            return (context, weights)
        return (context,)


def make_attention():
    return MultiHeadSelfAttention(DistilConfig())


EXPECT = {
    "target": "make_attention",
    "kind": "multihead",
    "ok": True,
    "style": "DistilBERT MultiHeadSelfAttention (q_lin/k_lin/v_lin/out_lin, pre-scaled queries, tuple output)",
}
