"""DistilBERT TransformerBlock; bug: queries are pre-divided by sqrt(dim_per_head) AND the scores are divided again."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.dim = config.dim
        self.dropout = nn.Dropout(p=config.attention_dropout)
        self.q_lin = nn.Linear(config.dim, config.dim)
        self.k_lin = nn.Linear(config.dim, config.dim)
        self.v_lin = nn.Linear(config.dim, config.dim)
        self.out_lin = nn.Linear(config.dim, config.dim)

    def forward(self, query, key, value, mask=None, output_attentions=False):
        bs, q_length, dim = query.size()
        dim_per_head = self.dim // self.n_heads

        def shape(x):
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

        q = shape(self.q_lin(query))
        k = shape(self.k_lin(key))
        v = shape(self.v_lin(value))

        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(dim_per_head)
        if mask is not None:
            hide = (mask == 0).view(bs, 1, 1, -1).expand_as(scores)
            scores = scores.masked_fill(hide, torch.finfo(scores.dtype).min)
        weights = self.dropout(nn.functional.softmax(scores, dim=-1))
        context = self.out_lin(unshape(torch.matmul(weights, v)))
        return (context, weights) if output_attentions else (context,)


class FFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lin1 = nn.Linear(config.dim, config.hidden_dim)
        self.lin2 = nn.Linear(config.hidden_dim, config.dim)
        self.activation = nn.GELU()

    def forward(self, x):
        return self.lin2(self.activation(self.lin1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = MultiHeadSelfAttention(config)
        self.sa_layer_norm = nn.LayerNorm(normalized_shape=config.dim, eps=1e-12)
        self.ffn = FFN(config)
        self.output_layer_norm = nn.LayerNorm(normalized_shape=config.dim, eps=1e-12)

    def forward(self, x, attn_mask=None):
        sa_output = self.attention(query=x, key=x, value=x, mask=attn_mask)[0]
        sa_output = self.sa_layer_norm(sa_output + x)
        ffn_output = self.output_layer_norm(self.ffn(sa_output) + sa_output)
        return (ffn_output,)


def make_block():
    return TransformerBlock(
        SimpleNamespace(dim=20, n_heads=4, hidden_dim=40, attention_dropout=0.0)
    )


EXPECT = {
    "target": "make_block",
    "kind": "multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "layer": "attention",
    "style": "DistilBERT TransformerBlock (scale applied twice: 1/d_head instead of 1/sqrt(d_head))",
}
