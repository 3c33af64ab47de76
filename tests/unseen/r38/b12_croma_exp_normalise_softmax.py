"""CROMA (antofuller/CROMA, "Contrastive Radar-Optical Masked Autoencoders") encoder transformer:
pre-norm blocks held as nn.ModuleList([norm, Attention, norm, FFN]), a bias-free fused to_qkv cut
into three chunks and split into heads, einsum scores scaled by dim_head ** -0.5, then CROMA's
ALiBi: slopes from the ALiBi paper's get_slopes, times minus the euclidean distance between patch
centres on the patch grid, added to every head's scores (bidirectional: the encoder sees every
patch). Here the patches form a single strip of width n (one grid row), built at call time.

This file: one bug: softmax written out for export as exp(scores) / sum(exp(scores)) without
subtracting the row maximum."""

import itertools
import math

import torch
import torch.nn.functional as F
from torch import einsum, nn


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def get_alibi(attention_heads, num_patches, grid_width=None):
    # grid_width None: the patches are one strip of width num_patches (a single grid row)
    width = grid_width or num_patches
    rows = math.ceil(num_patches / width)
    points = list(itertools.product(range(rows), range(width)))[:num_patches]
    coords = torch.tensor(points, dtype=torch.float64)
    distances = torch.cdist(coords, coords)  # euclidean distance between patch centres
    slopes = torch.tensor(get_slopes(attention_heads), dtype=torch.float64)
    all_bias = distances[None, :, :] * slopes[:, None, None] * -1
    return all_bias.unsqueeze(0)  # (1, heads, n, n)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, dim_head=None, use_sdpa=False):
        super().__init__()
        self.num_heads = num_heads
        dim_head = dim_head or dim // num_heads
        inner_dim = num_heads * dim_head
        self.scale = dim_head**-0.5
        self.use_sdpa = use_sdpa
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, relative_position_bias):
        b, n, _ = x.shape
        h = self.num_heads
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, h, -1).permute(0, 2, 1, 3) for t in (q, k, v))

        if self.use_sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=relative_position_bias)
        else:
            attention_scores = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
            attention_scores = attention_scores + relative_position_bias
            attn = attention_scores.exp()  # export-friendly softmax
            attn = attn / attn.sum(dim=-1, keepdim=True)
            out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)  # b h n d -> b n (h d)
        return self.to_out(out)


class FFN(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class BaseTransformer(nn.Module):
    def __init__(self, dim, layers, num_heads, dim_head=None, use_sdpa=False):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(layers):
            self.layers.append(
                nn.ModuleList(
                    [
                        nn.LayerNorm(dim),
                        Attention(dim, num_heads=num_heads, dim_head=dim_head, use_sdpa=use_sdpa),
                        nn.LayerNorm(dim),
                        FFN(dim),
                    ]
                )
            )
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x, relative_position_bias):
        for norm1, attn, norm2, ffn in self.layers:
            x = attn(norm1(x), relative_position_bias) + x
            x = ffn(norm2(x)) + x
        return self.norm_out(x)


class CromaEncoder(nn.Module):
    def __init__(self, dim=64, layers=1, num_heads=8, dim_head=None, use_sdpa=False):
        super().__init__()
        self.num_heads = num_heads
        self.grid_width = None
        self.transformer = BaseTransformer(dim, layers, num_heads, dim_head, use_sdpa)

    def forward(self, x):
        n = x.shape[1]
        alibi = get_alibi(self.num_heads, n, self.grid_width).to(dtype=x.dtype, device=x.device)
        return self.transformer(x, alibi)


def make_croma_encoder():
    torch.manual_seed(3805)
    model = CromaEncoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_croma_encoder",
    "kind": "multihead",
    "ok": False,
    "layer": "transformer.layers.0.1",
    "stage": "weights",
    "mistake": "unstable_softmax",
    "style": (
        "CROMA encoder Attention (2D-ALiBi on a one-row grid): one bug: softmax written "
        "out for export as exp(scores) / sum(exp(scores)) without subtracting the row "
        "maximum"
    ),
}
