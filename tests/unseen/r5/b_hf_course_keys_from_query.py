"""Hugging Face course / NLP-with-Transformers AttentionHead + MultiHeadAttention; bug: each head builds its keys with its query Linear."""

from math import sqrt
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def scaled_dot_product_attention(query, key, value):
    dim_k = query.size(-1)
    scores = torch.bmm(query, key.transpose(1, 2)) / sqrt(dim_k)
    weights = F.softmax(scores, dim=-1)
    return torch.bmm(weights, value)


class AttentionHead(nn.Module):
    def __init__(self, embed_dim, head_dim):
        super().__init__()
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(self, hidden_state):
        return scaled_dot_product_attention(
            self.q(hidden_state), self.q(hidden_state), self.v(hidden_state)
        )


class MultiHeadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        embed_dim = config.hidden_size
        num_heads = config.num_attention_heads
        head_dim = embed_dim // num_heads
        self.heads = nn.ModuleList([AttentionHead(embed_dim, head_dim) for _ in range(num_heads)])
        self.output_linear = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_state):
        x = torch.cat([h(hidden_state) for h in self.heads], dim=-1)
        return self.output_linear(x)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.gelu = nn.GELU()

    def forward(self, x):
        return self.linear_2(self.gelu(self.linear_1(x)))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm_1 = nn.LayerNorm(config.hidden_size)
        self.layer_norm_2 = nn.LayerNorm(config.hidden_size)
        self.attention = MultiHeadAttention(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x):
        x = x + self.attention(self.layer_norm_1(x))
        return x + self.feed_forward(self.layer_norm_2(x))


def make_encoder_layer():
    return TransformerEncoderLayer(
        SimpleNamespace(hidden_size=12, num_attention_heads=3, intermediate_size=24)
    )


EXPECT = {
    "target": "make_encoder_layer",
    "kind": "multihead",
    "ok": False,
    "stage": "keys",
    "mistake": "wrong_projection",
    "layer": "attention",
    "style": "Hugging Face course / NLP with Transformers book (AttentionHead ModuleList, keys made with self.q)",
}
