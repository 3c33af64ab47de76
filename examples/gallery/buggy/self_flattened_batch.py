"""Self-attention that "supports batches" by flattening batch and tokens into one long sequence."""

import torch
import torch.nn as nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = attn_weights @ values
        return context.reshape(*shape[:-1], -1)


EXPECT = {
    "target": "SelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "scores",
    "mistake": "batch_mixing",
}
