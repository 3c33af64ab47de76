"""Single-head self-attention that flattens (batch, tokens) into one long sequence before the matmuls: every token attends to the other sequence too."""

import torch
import torch.nn as nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        shape = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])  # (batch * tokens, d_in)
        queries = self.W_query(flat)
        keys = self.W_key(flat)
        values = self.W_value(flat)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = attn_weights @ values
        return context.reshape(*shape, -1)


EXPECT = {
    "target": "SelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "scores",
    "mistake": "batch_mixing",
    "style": "single-head W_query/W_key/W_value on a flattened batch",
}
