"""perceiver-pytorch latent self-attention; bug: scale is dim_head ** -1 rather than dim_head ** -0.5."""

from einops import rearrange
from torch import einsum, nn


def default(val, d):
    return val if val is not None else d


class Attention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.scale = dim_head**-1
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(context_dim, inner_dim * 2, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, query_dim)

    def forward(self, x, context=None, mask=None):
        h = self.heads
        q = self.to_q(x)
        context = default(context, x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> (b h) n d", h=h), (q, k, v))
        sim = einsum("b i d, b j d -> b i j", q, k) * self.scale
        attn = self.dropout(sim.softmax(dim=-1))
        out = einsum("b i j, b j d -> b i d", attn, v)
        out = rearrange(out, "(b h) n d -> b n (h d)", h=h)
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class LatentBlock(nn.Module):
    def __init__(self, latent_dim, latent_heads, latent_dim_head):
        super().__init__()
        self.latent_attn = PreNorm(
            latent_dim, Attention(latent_dim, heads=latent_heads, dim_head=latent_dim_head)
        )
        self.latent_ff = PreNorm(latent_dim, FeedForward(latent_dim))

    def forward(self, x):
        x = self.latent_attn(x) + x
        return self.latent_ff(x) + x


def make_latent_block():
    return LatentBlock(latent_dim=24, latent_heads=4, latent_dim_head=6)


EXPECT = {
    "target": "make_latent_block",
    "kind": "multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "layer": "latent_attn.fn",
    "style": "perceiver-pytorch latent block (PreNorm(Attention) at latent_attn.fn; scale dim_head ** -1)",
}
