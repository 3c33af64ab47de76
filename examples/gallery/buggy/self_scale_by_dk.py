"""Self-attention that divides the scores by d_k instead of sqrt(d_k)."""

import torch
import torch.nn as nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1], dim=-1)
        return attn_weights @ values


EXPECT = {
    "target": "SelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
}
