"""LightGlue (cvg, ETH Zurich) style transformer blocks, as in the LightGlue matcher and glue-factory:
a fused Wqkv laid out per head as (heads, head_dim, 3), rotary encodings applied with LightGlue's
interleaved rotate_half (pairs (2i, 2i+1)) and cos/sin repeated with repeat_interleave(2), the
attention message concatenated to the input and passed through the FFN. Here the descriptors are a
1-D token sequence, so the rotary angles come from token index times a fixed frequency table.
Self block, 4 heads x 16, SDPA path (flash=True), rotary base 1e4.

This file (base c05): one bug: the fused qkv is viewed straight to (b, heads, n, head_dim, 3) instead of unflatten to (b, n, heads, head_dim, 3) then transpose(1, 2): heads are cut across tokens."""

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


class Attention(nn.Module):
    def __init__(self, flash):
        super().__init__()
        self.flash = flash

    def forward(self, q, k, v):
        if self.flash:
            return F.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)
        s = q.shape[-1] ** -0.5
        sim = torch.einsum("...id,...jd->...ij", q, k) * s
        attn = F.softmax(sim, -1)
        return torch.einsum("...ij,...jd->...id", attn, v)


class SelfBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, flash=False, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.inner_attn = Attention(flash)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.ffn = nn.Sequential(
            nn.Linear(2 * embed_dim, 2 * embed_dim),
            nn.LayerNorm(2 * embed_dim, elementwise_affine=True),
            nn.GELU(),
            nn.Linear(2 * embed_dim, embed_dim),
        )

    def forward(self, x, encoding):
        qkv = self.Wqkv(x)
        qkv = qkv.view(qkv.shape[0], self.num_heads, qkv.shape[1], -1, 3)
        q, k, v = qkv[..., 0], qkv[..., 1], qkv[..., 2]
        q = apply_cached_rotary_emb(encoding, q)
        k = apply_cached_rotary_emb(encoding, k)
        context = self.inner_attn(q, k, v)
        message = self.out_proj(context.transpose(1, 2).flatten(start_dim=-2))
        return x + self.ffn(torch.cat([x, message], -1))


class LightGlueSequence(nn.Module):
    """One LightGlue self block over a descriptor sequence."""

    def __init__(self, descriptor_dim=64, num_heads=4, flash=True, rope_base=10000.0):
        super().__init__()
        self.posenc = TokenRotaryEncoding(descriptor_dim // num_heads, rope_base)
        self.self_attn = SelfBlock(descriptor_dim, num_heads, flash)
        self.norm = nn.LayerNorm(descriptor_dim)

    def forward(self, desc):
        encoding = self.posenc(desc)
        return self.norm(self.self_attn(desc, encoding))


def make_lightglue():
    torch.manual_seed(5005)
    model = LightGlueSequence()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_lightglue',
 'kind': 'multihead',
 'ok': False,
 'layer': 'self_attn',
 'stage': 'queries',
 'mistake': 'heads_split',
 'style': 'LightGlue (cvg) (b13): (base c05) one bug: the fused qkv is viewed straight to (b, '
          'heads, n, head_dim, 3) instead of unflatten to (b, n, heads, head_dim, 3) then '
          'transpose(1, 2): heads are cut across tokens'}
