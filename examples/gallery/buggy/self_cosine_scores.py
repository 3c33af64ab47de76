"""Self-attention that scores query/key pairs with cosine similarity instead of the dot product."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CosineSelfAttention(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = F.cosine_similarity(queries.unsqueeze(-2), keys.unsqueeze(-3), dim=-1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


EXPECT = {
    "target": "CosineSelfAttention",
    "kind": "self",
    "ok": False,
    "stage": "scores",
    "mistake": "not_dot_product",
}
