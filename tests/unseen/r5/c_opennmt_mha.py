"""OpenNMT-py MultiHeadedAttention: linear_keys/linear_values/linear_query/final_linear, shape/unshape, forward(key, value, query)."""

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
        dim_per_head = self.dim_per_head
        head_count = self.head_count
        key_len = key.size(1)
        query_len = query.size(1)

        def shape(x):
            """projection -> (batch, heads, len, dim_per_head)"""
            return x.view(batch_size, -1, head_count, dim_per_head).transpose(1, 2)

        def unshape(x):
            """(batch, heads, len, dim_per_head) -> (batch, len, model_dim)"""
            return x.transpose(1, 2).contiguous().view(batch_size, -1, head_count * dim_per_head)

        key = shape(self.linear_keys(key))
        value = shape(self.linear_values(value))
        query = shape(self.linear_query(query))

        query = query / math.sqrt(dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3)).float()
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1), -1e18)

        attn = self.softmax(scores).to(query.dtype)
        drop_attn = self.dropout(attn)
        context = unshape(torch.matmul(drop_attn, value))
        output = self.final_linear(context)

        top_attn = attn.view(batch_size, head_count, query_len, key_len)[:, 0, :, :].contiguous()
        return output, top_attn


def make_attention():
    return MultiHeadedAttention(head_count=3, model_dim=12, dropout=0.0)


EXPECT = {
    "target": "make_attention",
    "kind": "multihead",
    "ok": True,
    "style": "OpenNMT-py MultiHeadedAttention (encoder self-attention, forward(key, value, query), returns (output, top_attn))",
}
