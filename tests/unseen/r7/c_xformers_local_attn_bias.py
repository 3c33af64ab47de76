"""xformers-fmha-style block: BMHK tensors, a bottom-right local causal attn_bias (window of 4 keys incl. self)
materialized into an additive tensor, and a pure-torch memory_efficient_attention fallback."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class AttentionBias:
    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        raise NotImplementedError


class LowerTriangularFromBottomRightLocalAttentionMask(AttentionBias):
    """Causal, aligned to the bottom-right corner, and local: query q sees keys k with q - window_size < k <= q."""

    def __init__(self, window_size):
        if window_size <= 0:
            raise ValueError(f"Expected window_size > 0, got {window_size}")
        self._window_size = window_size

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        num_queries, num_keys = shape[-2], shape[-1]
        shift = num_keys - num_queries
        full = torch.full((num_queries, num_keys), float("-inf"), dtype=dtype, device=device)
        visible = torch.tril(torch.ones_like(full, dtype=torch.bool), diagonal=shift)
        visible &= torch.triu(
            torch.ones_like(full, dtype=torch.bool), diagonal=shift - self._window_size + 1
        )
        return full.masked_fill(visible, 0.0).expand(shape)


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
    """query/key/value: [B, M, H, K] (xformers' BMHK). Reference path: one SDPA call in BHMK."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    bias = None
    if attn_bias is not None:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        bias = attn_bias.materialize(shape, dtype=q.dtype, device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=scale)
    return out.transpose(1, 2)


class LocalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, window_size, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, M, C = x.shape
        qkv = self.qkv(x).reshape(B, M, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(2)  # each [B, M, H, K]
        bias = LowerTriangularFromBottomRightLocalAttentionMask(self.window_size)
        out = memory_efficient_attention(q, k, v, attn_bias=bias)
        return self.proj(out.reshape(B, M, C))


class LocalBlock(nn.Module):
    def __init__(self, dim=48, num_heads=3, window_size=4, mlp_ratio=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = LocalSelfAttention(dim, num_heads, window_size)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim)
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


EXPECT = {
    "target": "LocalBlock",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 3,
        "kv_heads": 3,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": 4,
        "bias": None,
    },
    "style": "xformers fmha style (BMHK q/k/v from qkv.unbind(2), LowerTriangularFromBottomRightLocalAttentionMask(window_size=4).materialize() as an additive SDPA mask, timm-like block)",
}
