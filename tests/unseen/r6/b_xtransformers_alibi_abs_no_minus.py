"""lucidrains x-transformers style decoder with AlibiPositionalBias (standard slopes, bias built from the
query/key distance and cached, added to the scaled dots before the causal mask) and plain multi-head
attention; bug: get_bias returns abs(j - i) without the minus sign, so every head rewards distance and
favours the oldest tokens."""

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import einsum, nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class AlibiPositionalBias(nn.Module):
    def __init__(self, heads, total_heads=None, slopes=None):
        super().__init__()
        self.heads = heads
        self.total_heads = default(total_heads, heads)
        slopes = torch.Tensor(default(slopes, self._get_slopes(heads)))
        slopes = rearrange(slopes, "h -> h 1 1")
        self.register_buffer("slopes", slopes, persistent=False)
        self.register_buffer("bias", None, persistent=False)

    @property
    def device(self):
        return next(self.buffers()).device

    @staticmethod
    def _get_slopes(heads):
        def get_slopes_power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            ratio = start
            return [start * ratio**i for i in range(n)]

        if math.log2(heads).is_integer():
            return get_slopes_power_of_2(heads)

        closest_power_of_2 = 2 ** math.floor(math.log2(heads))
        return (
            get_slopes_power_of_2(closest_power_of_2)
            + get_slopes_power_of_2(2 * closest_power_of_2)[0::2][: heads - closest_power_of_2]
        )

    def get_bias(self, i, j, device):
        seq_arange = torch.arange(j - i, j, device=device)
        context_arange = torch.arange(j, device=device)
        bias = torch.abs(
            rearrange(context_arange, "j -> 1 1 j") - rearrange(seq_arange, "i -> 1 i 1")
        )
        return bias

    def forward(self, i, j):
        h = self.total_heads
        if exists(self.bias) and self.bias.shape[-1] >= j and self.bias.shape[-2] >= i:
            return self.bias[..., -i:, -j:]
        bias = self.get_bias(i, j, self.device)
        bias = bias * self.slopes
        num_heads_unalibied = h - bias.shape[0]
        bias = F.pad(bias, (0, 0, 0, 0, 0, num_heads_unalibied))
        self.register_buffer("bias", bias, persistent=False)
        return self.bias


class Attention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=8, causal=True):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        self.causal = causal
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, rel_pos=None):
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=h) for t in (q, k, v))

        dots = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = dots.shape[-2:]
        if exists(rel_pos):
            dots = dots + rel_pos(i, j)

        mask_value = -torch.finfo(dots.dtype).max
        if self.causal:
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=dots.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)

        attn = dots.softmax(dim=-1)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class Decoder(nn.Module):
    def __init__(self, dim=64, depth=1, heads=8, dim_head=8, alibi_num_heads=None):
        super().__init__()
        alibi_num_heads = default(alibi_num_heads, heads)
        self.rel_pos = AlibiPositionalBias(heads=alibi_num_heads, total_heads=heads)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(
                nn.ModuleList(
                    [
                        nn.LayerNorm(dim),
                        Attention(dim, dim_head=dim_head, heads=heads, causal=True),
                        nn.LayerNorm(dim),
                        nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
                    ]
                )
            )
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x):
        for attn_norm, attn, ff_norm, ff in self.layers:
            x = attn(attn_norm(x), rel_pos=self.rel_pos) + x
            x = ff(ff_norm(x)) + x
        return self.final_norm(x)


def make_decoder():
    return Decoder()


EXPECT = {
    "target": "make_decoder",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "layer": "layers.0.1",
    "style": "lucidrains x-transformers AlibiPositionalBias (standard slopes, cached bias buffer) with einsum attention, 8 heads; get_bias returns abs(j - i) without the minus",
}
