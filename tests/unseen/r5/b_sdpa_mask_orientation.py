"""Decoder attention calling F.scaled_dot_product_attention with a boolean mask; bug: the mask is triu (True = may attend, for SDPA), so tokens see the future, not the past."""

import torch
import torch.nn.functional as F
from torch import nn


class DecoderSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads, context_length=64, qkv_bias=True):
        super().__init__()
        assert d_model % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=qkv_bias)
        self.proj = nn.Linear(d_model, d_model)
        allowed = torch.ones(context_length, context_length, dtype=torch.bool).triu()
        self.register_buffer("allowed", allowed, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed[:T, :T])
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


EXPECT = {
    "target": "DecoderSelfAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "style": "SDPA decoder attention with a bool mask buffer of the wrong orientation (triu keeps keys j >= i)",
}
