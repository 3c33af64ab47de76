"""Decoder cross-attention over an encoder memory of another width: keys and values come from `memory`, which forward requires."""

import math

import torch
import torch.nn as nn


class CrossAttention(nn.Module):
    def __init__(self, d_model, d_memory, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_memory, d_model)
        self.v_proj = nn.Linear(d_memory, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, memory, memory_key_padding_mask=None):
        B, T, _ = x.shape
        S = memory.shape[1]
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(memory).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(memory).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if memory_key_padding_mask is not None:
            scores = scores.masked_fill(memory_key_padding_mask[:, None, None, :], float("-inf"))
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(B, T, -1)
        return self.out_proj(out)


def make_cross_attention():
    return CrossAttention(d_model=24, d_memory=16, num_heads=4)


EXPECT = {
    "target": "make_cross_attention",
    "kind": "multihead",
    "unsupported": "cross",
    "style": "encoder-decoder cross-attention (memory argument required)",
}
