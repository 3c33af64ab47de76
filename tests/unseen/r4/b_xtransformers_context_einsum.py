"""lucidrains x-transformers/perceiver-style Attention (to_q plus a fused to_kv, einsum); bug: the context einsum sums over the queries ('b h i j, b h i d -> b h j d')."""

import torch
from einops import rearrange
from torch import einsum, nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        self.scale = dim_head**-0.5
        self.heads = heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, context=None, mask=None):
        h = self.heads
        context = default(context, x)
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=h), (q, k, v))
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        if exists(mask):
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        out = einsum("b h i j, b h i d -> b h j d", attn, v)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


EXPECT = {
    "target": "Attention",
    "kind": "multihead",
    "ok": False,
    "stage": "context",
    "mistake": "context_wrong_product",
    "init": {"dim": 24, "heads": 4, "dim_head": 6},
    "style": "lucidrains x-transformers / perceiver Attention (to_q, to_kv, einsum)",
}
