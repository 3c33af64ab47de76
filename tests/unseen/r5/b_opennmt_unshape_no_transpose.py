"""OpenNMT-py MultiHeadedAttention; bug: unshape views (batch, heads, len, d) straight to (batch, len, model_dim) without transposing back."""

import math

import torch
import torch.nn as nn


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, dropout=0.1):
        assert model_dim % head_count == 0
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim
        super().__init__()
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_values = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_query = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(model_dim, model_dim)

    def forward(self, key, value, query, mask=None):
        batch_size = key.size(0)
        key_len = key.size(1)
        query_len = query.size(1)
        dim_per_head = self.dim_per_head
        head_count = self.head_count

        def shape(x):
            return x.view(batch_size, -1, head_count, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.contiguous().view(batch_size, -1, head_count * dim_per_head)

        key = shape(self.linear_keys(key))
        value = shape(self.linear_values(value))
        query = shape(self.linear_query(query))

        query = query / math.sqrt(dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3))
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1), -1e18)
        attn = self.softmax(scores)
        context = unshape(torch.matmul(self.dropout(attn), value))
        output = self.final_linear(context)
        top_attn = attn.view(batch_size, head_count, query_len, key_len)[:, 0, :, :].contiguous()
        return output, top_attn


def make_attention():
    return MultiHeadedAttention(head_count=4, model_dim=24, dropout=0.0)


EXPECT = {
    "target": "make_attention",
    "kind": "multihead",
    "ok": False,
    "stage": "output",
    "mistake": "heads_merge",
    "style": "OpenNMT-py MultiHeadedAttention (unshape without transpose(1, 2))",
}
