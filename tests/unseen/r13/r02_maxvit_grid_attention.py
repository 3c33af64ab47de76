"""MaxViT-style grid attention (lucidrains vit-pytorch MaxViT lineage) on a 1-D token sequence:
to_qkv fused Linear chunked with einops, heads 'b n (h d) -> b h n d', q * scale, einsum similarity,
then the grid partition: token i only attends to tokens j with (i - j) % grid == 0 (the dilated,
strided 'grid' half of MaxViT's block/grid pair, written as a mask so any length works), softmax,
einsum out, to_out.

This file: refused (a strided grid sparsity pattern is neither causal nor a sliding window)."""

import torch
from einops import rearrange
from torch import einsum, nn


class GridAttention(nn.Module):
    def __init__(self, dim=64, dim_head=16, grid_size=4):
        super().__init__()
        self.heads = dim // dim_head
        self.scale = dim_head**-0.5
        self.grid_size = grid_size
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        n, device = x.shape[1], x.device
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), (q, k, v))
        q = q * self.scale
        sim = einsum("b h i d, b h j d -> b h i j", q, k)
        pos = torch.arange(n, device=device)
        same_grid_cell = (pos[:, None] - pos[None, :]) % self.grid_size == 0
        sim = sim.masked_fill(~same_grid_cell, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class MaxViTGridBlock(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = GridAttention(dim)
        self.ff = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim)
        )

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.ff(x)


def make_maxvit_grid_block():
    torch.manual_seed(1392)
    model = MaxViTGridBlock()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_maxvit_grid_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "grid_attention",
    "style": "MaxViT grid attention (vit-pytorch lineage) on a token sequence: each token attends only to the "
    "tokens of its grid cell, (i - j) % grid_size == 0, masked with -finfo.max",
}
