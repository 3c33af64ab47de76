"""Self-attention scaling by sqrt of the input width d_in rather than the key size d_out."""

import torch
import torch.nn as nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.scale = d_in**0.5

    def forward(self, x):
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1) / self.scale
        attn_weights = torch.softmax(attn_scores, dim=-1)
        return attn_weights @ values


EXPECT = {
    "target": "SelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
}
