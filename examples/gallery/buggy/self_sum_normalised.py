"""Self-attention normalising scaled scores by their row sum (book's naive way), not softmax."""

import torch.nn as nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1) / keys.shape[-1] ** 0.5
        attn_weights = attn_scores / attn_scores.sum(dim=-1, keepdim=True)
        return attn_weights @ values


EXPECT = {
    "target": "SelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
}
