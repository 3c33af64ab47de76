"""Conformer (sooftware-style) MHSA module without relative positions; bug: a hand-written softmax exp(x)/sum(exp(x)) with no max subtraction."""

import math

import torch
import torch.nn as nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model=512, num_heads=8, dropout_p=0.0):
        super().__init__()
        assert d_model % num_heads == 0, "d_model % num_heads should be zero."
        self.d_model = d_model
        self.d_head = int(d_model / num_heads)
        self.num_heads = num_heads
        self.sqrt_dim = math.sqrt(self.d_head)

        self.query_proj = nn.Linear(d_model, d_model)
        self.key_proj = nn.Linear(d_model, d_model)
        self.value_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(p=dropout_p)
        self.out_proj = nn.Linear(d_model, d_model)

    @staticmethod
    def _softmax(score):
        e = torch.exp(score)
        return e / e.sum(dim=-1, keepdim=True)

    def forward(self, query, key, value, mask=None):
        batch_size, _, _ = value.size()
        query = (
            self.query_proj(query)
            .view(batch_size, -1, self.num_heads, self.d_head)
            .permute(0, 2, 1, 3)
        )
        key = (
            self.key_proj(key).view(batch_size, -1, self.num_heads, self.d_head).permute(0, 2, 1, 3)
        )
        value = (
            self.value_proj(value)
            .view(batch_size, -1, self.num_heads, self.d_head)
            .permute(0, 2, 1, 3)
        )

        score = torch.matmul(query, key.transpose(2, 3)) / self.sqrt_dim
        if mask is not None:
            score.masked_fill_(mask.unsqueeze(1), -1e9)
        attn = self.dropout(self._softmax(score))
        context = torch.matmul(attn, value).transpose(1, 2)
        context = context.contiguous().view(batch_size, -1, self.d_model)
        return self.out_proj(context)


class MultiHeadedSelfAttentionModule(nn.Module):
    def __init__(self, d_model, num_heads, dropout_p=0.0):
        super().__init__()
        self.layer_norm = nn.LayerNorm(d_model)
        self.attention = MultiHeadAttention(d_model, num_heads, dropout_p)
        self.dropout = nn.Dropout(p=dropout_p)

    def forward(self, inputs, mask=None):
        inputs = self.layer_norm(inputs)
        return self.dropout(self.attention(inputs, inputs, inputs, mask=mask))


def make_attention():
    """The bare attention of the conformer MHSA module (its LayerNorm would hide large inputs)."""
    return MultiHeadedSelfAttentionModule(d_model=12, num_heads=3).attention


EXPECT = {
    "target": "make_attention",
    "kind": "multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "unstable_softmax",
    "style": "Conformer MultiHeadAttention (sooftware style, forward(query, key, value, mask), no rel pos; exp/sum softmax overflows)",
}
