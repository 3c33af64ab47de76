"""Encoder self-attention with a learned relative position bias: an nn.Embedding of clipped distances gives one bias per head, added to the scaled scores."""

import math

import torch
import torch.nn as nn


class RelPosSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads, max_distance=16, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.max_distance = max_distance
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.relative_attention_bias = nn.Embedding(2 * max_distance + 1, num_heads)
        self.dropout = nn.Dropout(dropout)

    def compute_bias(self, query_length, key_length, device=None):
        context_position = torch.arange(query_length, device=device)[:, None]
        memory_position = torch.arange(key_length, device=device)[None, :]
        relative_position = (memory_position - context_position).clamp(
            -self.max_distance, self.max_distance
        )
        values = self.relative_attention_bias(
            relative_position + self.max_distance
        )  # (q, k, heads)
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, heads, q, k)

    def forward(self, hidden_states, attention_mask=None):
        B, T, C = hidden_states.shape

        def shape(t):
            return t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = (
            shape(self.q(hidden_states)),
            shape(self.k(hidden_states)),
            shape(self.v(hidden_states)),
        )
        scores = torch.matmul(q, k.transpose(3, 2)) / math.sqrt(self.head_dim)
        scores = scores + self.compute_bias(T, T, hidden_states.device)
        if attention_mask is not None:
            scores = scores + attention_mask
        attn = self.dropout(torch.softmax(scores.float(), dim=-1).type_as(scores))
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, T, C)
        return self.o(out)


EXPECT = {
    "target": "RelPosSelfAttention",
    "kind": "multihead",
    "unsupported": "relative_bias",
    "style": "learned relative position bias (T5-like table, clipped distances, scaled)",
}
