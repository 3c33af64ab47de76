"""Causal attention passing a boolean tril buffer as attn_mask to scaled_dot_product_attention."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSDPAAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        allowed = torch.tril(torch.ones(context_length, context_length, dtype=torch.bool))
        self.register_buffer("allowed", allowed)

    def forward(self, x):
        t = x.shape[-2]
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.allowed[:t, :t])


EXPECT = {"target": "CausalSDPAAttention", "kind": "causal", "ok": True}
