"""LLMs-from-scratch chapter-3 SelfAttention_v2: one head, W_query/W_key/W_value Linears, keys.T, written for unbatched (tokens, d_in) input."""

import torch
import torch.nn as nn


class SelfAttention_v2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.T  # (tokens, tokens); only meaningful for 2-D input
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


EXPECT = {
    "target": "SelfAttention_v2",
    "kind": "self",
    "ok": True,
    "style": "LLMs-from-scratch SelfAttention_v2 (single head, no output projection, keys.T: unbatched input only)",
}
