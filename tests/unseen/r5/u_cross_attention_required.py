"""T5/BART-style encoder-decoder cross-attention whose encoder states are a required argument."""

import math

import torch
from torch import nn


class EncDecAttention(nn.Module):
    def __init__(self, d_model, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states, key_value_states, encoder_attention_mask=None):
        bsz, tgt_len, d = hidden_states.shape
        src_len = key_value_states.shape[1]

        q = self.q(hidden_states).view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = (
            self.k(key_value_states)
            .view(bsz, src_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        v = (
            self.v(key_value_states)
            .view(bsz, src_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )

        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if encoder_attention_mask is not None:
            scores = scores.masked_fill(
                encoder_attention_mask[:, None, None, :] == 0, float("-inf")
            )
        probs = self.dropout(torch.softmax(scores, dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(bsz, tgt_len, d)
        return self.o(out)


EXPECT = {
    "target": "EncDecAttention",
    "kind": "multihead",
    "unsupported": "cross",
    "style": "encoder-decoder cross-attention (forward(hidden_states, key_value_states) with no default)",
}
