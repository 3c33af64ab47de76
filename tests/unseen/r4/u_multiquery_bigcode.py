"""GPTBigCode/StarCoder-style multi-query attention: one shared key/value head; c_attn emits [q (all heads), k, v] and queries are folded as (batch, seq*heads, head_dim)."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class MultiQueryAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_heads = 1
        self.kv_dim = self.kv_heads * self.head_dim
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)),
            persistent=False,
        )

    def _attn(self, query, key, value):
        # query: (batch, q_len, heads, head_dim); key/value: (batch, k_len, head_dim)
        batch_size, query_length = query.shape[0], query.shape[1]
        key_length = key.size(1)
        query = query.reshape(batch_size, query_length * self.num_heads, self.head_dim)
        attn_weights = torch.bmm(query, key.transpose(1, 2)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights.view(batch_size, query_length, self.num_heads, key_length)
        causal = self.bias[key_length - query_length : key_length, :key_length]
        attn_weights = attn_weights.masked_fill(
            ~causal[:, None, :], torch.finfo(attn_weights.dtype).min
        )
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(
            attn_weights.view(batch_size, query_length * self.num_heads, key_length), value
        )
        return attn_output.view(batch_size, query_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, layer_past=None, attention_mask=None):
        B, T, _ = hidden_states.shape
        query, key_value = self.c_attn(hidden_states).split(
            (self.embed_dim, 2 * self.kv_dim), dim=2
        )
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)
        query = query.view(B, T, self.num_heads, self.head_dim)
        attn_output = self._attn(query, key, value)
        return self.c_proj(attn_output), None


def make_mqa():
    return MultiQueryAttention(
        SimpleNamespace(hidden_size=24, num_attention_heads=4, max_position_embeddings=64)
    )


EXPECT = {
    "target": "make_mqa",
    "kind": "causal-multihead",
    "unsupported": "grouped",
    "style": "GPTBigCode / StarCoder multi-query attention (one kv head)",
}
