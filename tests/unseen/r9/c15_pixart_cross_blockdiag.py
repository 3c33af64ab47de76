"""PixArt-alpha MultiHeadCrossAttention (diffusion/model/nets/PixArt_blocks.py).

The whole batch is packed into one sequence: q is viewed (1, B*N, heads, d), k and v
(1, B*M, heads, d) from a fused kv_linear, and a block-diagonal bias (xformers
BlockDiagonalMask.from_seqlens([N]*B, [M]*B)) keeps every image attending only to its own
caption. Here the xformers call is replaced by its torch equivalent on a materialised
additive block-diagonal bias. The caption goes through the block's y_embedder (48 -> 64)
before the layer, so the layer's context is 64 wide.
"""

import torch
from torch import nn


def block_diagonal_bias(q_seqlens, kv_seqlens, dtype):
    total_q, total_kv = sum(q_seqlens), sum(kv_seqlens)
    bias = torch.full((total_q, total_kv), float("-inf"), dtype=dtype)
    qs, ks = 0, 0
    for nq, nk in zip(q_seqlens, kv_seqlens):
        bias[qs : qs + nq, ks : ks + nk] = 0
        qs, ks = qs + nq, ks + nk
    return bias


def memory_efficient_attention(q, k, v, p=0.0, attn_bias=None):
    # q, k, v: (1, L, H, D)  (xformers BMHK layout)
    scale = q.shape[-1] ** -0.5
    q = q.permute(0, 2, 1, 3) * scale
    k = k.permute(0, 2, 1, 3)
    v = v.permute(0, 2, 1, 3)
    attn = q @ k.transpose(-2, -1)
    if attn_bias is not None:
        attn = attn + attn_bias
    attn = attn.softmax(-1)
    return (attn @ v).permute(0, 2, 1, 3).contiguous()


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, cond, mask=None):
        B, N, C = x.shape
        M = cond.shape[1]
        q = self.q_linear(x).view(1, -1, self.num_heads, self.head_dim)
        kv = self.kv_linear(cond).view(1, -1, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(2)
        attn_bias = None
        if mask is None:
            mask = [M] * B
        attn_bias = block_diagonal_bias([N] * B, mask, x.dtype)
        x = memory_efficient_attention(q, k, v, p=self.attn_drop.p, attn_bias=attn_bias)
        x = x.view(B, -1, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class CaptionEmbedder(nn.Module):
    def __init__(self, in_channels, hidden_size):
        super().__init__()
        self.y_proj = nn.Sequential(
            nn.Linear(in_channels, hidden_size),
            nn.GELU(approximate="tanh"),
            nn.Linear(hidden_size, hidden_size),
        )

    def forward(self, caption):
        return self.y_proj(caption)


class PixArtCrossPart(nn.Module):
    def __init__(self, hidden_size=64, caption_channels=48, num_heads=4):
        super().__init__()
        self.y_embedder = CaptionEmbedder(caption_channels, hidden_size)
        self.cross_attn = MultiHeadCrossAttention(hidden_size, num_heads)

    def forward(self, x, y):
        y = self.y_embedder(y)
        return x + self.cross_attn(x, y)


def make_pixart_cross():
    torch.manual_seed(115)
    return PixArtCrossPart().eval()


EXPECT = {
    "target": "make_pixart_cross",
    "kind": "cross",
    "ok": True,
    "layer": "cross_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "PixArt-alpha MultiHeadCrossAttention (q_linear + fused kv_linear, whole batch packed into one (1, B*N, H, D) "
    "sequence with an xformers-style block-diagonal bias, torch fallback for memory_efficient_attention), caption "
    "y_embedder 48 -> 64 in the block",
}
