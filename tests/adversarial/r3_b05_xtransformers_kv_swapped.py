"""x-transformers-like Attention unpacking the combined to_kv projection as (v, k) instead of (k, v)."""

import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=5, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))

    def forward(self, x, context=None):
        h = self.heads
        context = x if context is None else context
        q = self.to_q(x)
        v, k = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = map(
            lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3), (q, k, v)
        )
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = dots.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.permute(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)
        return self.to_out(out)


EXPECT = {
    "target": "Attention",
    "kind": "multihead",
    "ok": False,
    "stage": "keys",
    "mistake": "wrong_projection",
}
