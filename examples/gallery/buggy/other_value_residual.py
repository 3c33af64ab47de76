"""Self-attention that adds the values back onto the context as a "residual" connection."""

import torch
import torch.nn as nn


class ResidualSelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = attn_weights @ values + values
        return context


EXPECT = {
    "target": "ResidualSelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "context",
    "mistake": "other",
}
