"""LightGlue (cvg, ETH Zurich) style transformer blocks, as in the LightGlue matcher and glue-factory:
a fused Wqkv laid out per head as (heads, head_dim, 3), rotary encodings applied with LightGlue's
interleaved rotate_half (pairs (2i, 2i+1)) and cos/sin repeated with repeat_interleave(2), the
attention message concatenated to the input and passed through the FFN. Here the descriptors are a
1-D token sequence, so the rotary angles come from token index times a fixed frequency table.
Cross block (one direction), 8 heads x 8, eager einsum, separate to_q and fused to_kv.

This file (base c08): one bug: F.softmax(sim, dim=1): the weights are normalised over the heads axis of (b, h, i, j) instead of over keys."""

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(start_dim=-2)


def apply_cached_rotary_emb(freqs, t):
    return (t * freqs[0]) + (rotate_half(t) * freqs[1])


class TokenRotaryEncoding(nn.Module):
    """cos/sin of position * inv_freq, built in float64 per call, stacked as LightGlue's (2, 1, 1, n, d)."""

    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim = head_dim
        self.base = base

    def forward(self, x):
        n = x.shape[-2]
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cosines, sines = torch.cos(angles), torch.sin(angles)
        emb = torch.stack([cosines, sines], 0)[:, None, None]
        return emb.repeat_interleave(2, dim=-1).to(x.dtype)


class CrossBlock(nn.Module):
    """One direction of LightGlue's cross block: descriptors of image 0 attend to those of image 1.
    Separate to_q and fused to_kv projections (glue-factory variant)."""

    def __init__(self, embed_dim, num_heads, flash=False, bias=True):
        super().__init__()
        self.heads = num_heads
        dim_head = embed_dim // num_heads
        self.scale = dim_head**-0.5
        inner_dim = dim_head * num_heads
        self.to_q = nn.Linear(embed_dim, inner_dim, bias=bias)
        self.to_kv = nn.Linear(embed_dim, 2 * inner_dim, bias=bias)
        self.to_out = nn.Linear(inner_dim, embed_dim, bias=bias)
        self.flash = flash
        self.ffn = nn.Sequential(
            nn.Linear(2 * embed_dim, 2 * embed_dim),
            nn.LayerNorm(2 * embed_dim, elementwise_affine=True),
            nn.GELU(),
            nn.Linear(2 * embed_dim, embed_dim),
        )

    def forward(self, x0, x1):
        q0 = self.to_q(x0)
        k1, v1 = self.to_kv(x1).chunk(2, dim=-1)
        q0, k1, v1 = map(lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2), (q0, k1, v1))
        if self.flash:
            m0 = F.scaled_dot_product_attention(q0, k1, v1, scale=self.scale)
        else:
            sim = torch.einsum("bhid,bhjd->bhij", q0, k1) * self.scale
            attn01 = F.softmax(sim, dim=1)
            m0 = torch.einsum("bhij,bhjd->bhid", attn01, v1)
        m0 = self.to_out(m0.transpose(1, 2).flatten(start_dim=-2))
        return x0 + self.ffn(torch.cat([x0, m0], -1))


class LightGlueCrossLayer(nn.Module):
    def __init__(self, descriptor_dim=64, num_heads=8, flash=False):
        super().__init__()
        self.cross_attn = CrossBlock(descriptor_dim, num_heads, flash)
        self.norm = nn.LayerNorm(descriptor_dim)

    def forward(self, desc0, desc1):
        return self.norm(self.cross_attn(desc0, desc1))


def make_lightglue_cross():
    torch.manual_seed(5008)
    model = LightGlueCrossLayer()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_lightglue_cross',
 'kind': 'cross',
 'ok': False,
 'layer': 'cross_attn',
 'stage': 'weights',
 'mistake': 'softmax_wrong_dim',
 'style': 'LightGlue (cvg) (b19): (base c08) one bug: F.softmax(sim, dim=1): the weights are '
          'normalised over the heads axis of (b, h, i, j) instead of over keys'}
