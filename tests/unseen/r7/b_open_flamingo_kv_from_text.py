"""OpenFlamingo-style GatedCrossAttentionBlock; bug: MaskedCrossAttention projects keys and values from the text
tokens instead of the visual features (both are 64 wide, so nothing fails)."""

import torch
from einops import rearrange
from torch import einsum, nn


def exists(val):
    return val is not None


def FeedForward(dim, mult=4):
    inner_dim = int(dim * mult)
    return nn.Sequential(
        nn.LayerNorm(dim),
        nn.Linear(dim, inner_dim, bias=False),
        nn.GELU(),
        nn.Linear(inner_dim, dim, bias=False),
    )


class MaskedCrossAttention(nn.Module):
    def __init__(self, *, dim, dim_visual, dim_head=16, heads=4):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, media):
        """x: (b, t_txt, d) already normed by the block; media: (b, t_img, d_visual) flattened image latents."""
        h = self.heads
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=h) for t in (q, k, v))
        q = q * self.scale
        sim = einsum("... i d, ... j d -> ... i j", q, k)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = einsum("... i j, ... j d -> ... i d", attn, v)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, dim=64, dim_visual=64, dim_head=16, heads=4, ff_mult=2):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = MaskedCrossAttention(
            dim=dim, dim_visual=dim_visual, dim_head=dim_head, heads=heads
        )
        self.attn_gate = nn.Parameter(torch.tensor([0.0]))
        self.ff = FeedForward(dim, mult=ff_mult)
        self.ff_gate = nn.Parameter(torch.tensor([0.0]))

    def forward(self, x, media):
        x = self.attn(self.norm(x), media) * self.attn_gate.tanh() + x
        return self.ff(x) * self.ff_gate.tanh() + x


def make_gated_xattn():
    block = GatedCrossAttentionBlock()
    with torch.no_grad():
        # trained gates are open (they start at 0, which hides the attention completely)
        block.attn_gate.fill_(0.8)
        block.ff_gate.fill_(0.5)
    return block


EXPECT = {
    "target": "make_gated_xattn",
    "kind": "cross",
    "ok": False,
    "stage": "keys",
    "mistake": "wrong_source",
    "layer": "attn",
    "style": "OpenFlamingo GatedCrossAttentionBlock/MaskedCrossAttention (to_q, to_kv.chunk(2), tanh gates, einsum with amax-stabilized softmax), no media-location masking; to_kv(x) instead of to_kv(media)",
}
