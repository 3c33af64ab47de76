"""Perceiver-style latent cross-attention block (lucidrains-like einops code): latents (64) attend to a context (48)
with 4 query heads sharing 2 kv heads, l2-normalize-based RMSNorm on q and k per head, pre-norms and residual outside the attention."""

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import einsum, nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class CrossAttention(nn.Module):
    def __init__(self, dim, context_dim=None, dim_head=16, heads=4, kv_heads=2, qk_norm=True):
        super().__init__()
        context_dim = default(context_dim, dim)
        self.heads = heads
        self.kv_heads = kv_heads
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_kv = nn.Linear(context_dim, dim_head * kv_heads * 2, bias=False)
        self.q_norm = RMSNorm(dim_head) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(dim_head) if qk_norm else nn.Identity()
        self.to_out = nn.Linear(dim_head * heads, dim, bias=False)

    def forward(self, x, context):
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q = rearrange(q, "b n (h d) -> b h n d", h=self.heads)
        k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.kv_heads) for t in (k, v))

        q = self.q_norm(q)
        k = self.k_norm(k)

        # each kv head serves a contiguous group of query heads
        groups = self.heads // self.kv_heads
        k, v = (repeat(t, "b h n d -> b (h g) n d", g=groups) for t in (k, v))

        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.net(x)


class LatentCrossAttentionBlock(nn.Module):
    def __init__(self, dim=64, context_dim=48, dim_head=16, heads=4, kv_heads=2):
        super().__init__()
        self.norm_latents = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim)
        self.attn = CrossAttention(
            dim, context_dim, dim_head=dim_head, heads=heads, kv_heads=kv_heads
        )
        self.ff = FeedForward(dim)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            self.attn.q_norm.gamma.copy_(0.5 + torch.rand(dim_head, generator=g))
            self.attn.k_norm.gamma.copy_(0.5 + torch.rand(dim_head, generator=g))

    def forward(self, latents, context):
        latents = latents + self.attn(self.norm_latents(latents), self.norm_context(context))
        return latents + self.ff(latents)


EXPECT = {
    "target": "LatentCrossAttentionBlock",
    "kind": "cross",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "lucidrains-style Perceiver latent cross-attention (to_q, to_kv.chunk(2), einops rearrange/repeat 'b h n d -> b (h g) n d', F.normalize RMSNorm q_norm/k_norm, einsum sim), LayerNorms and residual in the block",
}
