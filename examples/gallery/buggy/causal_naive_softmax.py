"""Causal attention with the book's softmax_naive (exp / sum exp): overflows on large scores."""

import torch
import torch.nn as nn


def softmax_naive(x):
    return torch.exp(x) / torch.exp(x).sum(dim=-1, keepdim=True)


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = softmax_naive(attn_scores / keys.shape[-1] ** 0.5)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


EXPECT = {
    "target": "CausalAttention",
    "kind": "causal",
    "ok": False,
    "stage": "weights",
    "mistake": "unstable_softmax",
}
