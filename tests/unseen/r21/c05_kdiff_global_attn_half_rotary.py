"""k-diffusion (crowsonkb) image_transformer_v2 style global self-attention, reduced to a 1-D token
sequence: SelfAttentionBlock with a pre-norm RMSNorm (AdaRMSNorm without the conditioning), one fused
qkv_proj split as "n l (t nh e) -> t n nh l e", rotary embedding on the first half of each head only
(theta has d_head // 4 frequencies; apply_rotary_emb rotates x[..., :d] with x[..., d:2d] and passes
x[..., 2d:] through), non-causal attention, out_proj, residual. The original's cosine-similarity
scale and zero-initialised out_proj are replaced by 1/sqrt(d_head) and random weights (except in r01).

This file: correct (4 heads of 16, rotary on 8 of 16 dims, base 1e4)."""

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, shape, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(shape))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def apply_rotary_emb(x, theta):
    d = theta.shape[-1]
    x1, x2, x3 = x[..., :d], x[..., d : d * 2], x[..., d * 2 :]
    cos, sin = torch.cos(theta).to(x.dtype), torch.sin(theta).to(x.dtype)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2, x3), dim=-1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RoPE1d(nn.Module):
    """Positions 0..L-1; dim = number of rotated pairs (d_head // 4)."""

    def __init__(self, dim, base):
        super().__init__()
        freqs = base ** (-torch.arange(dim, dtype=torch.float64) / dim)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, length):
        pos = torch.arange(length, dtype=torch.float64, device=self.freqs.device)
        return pos[:, None] * self.freqs.double()[None, :]


class SelfAttention(nn.Module):
    def __init__(self, d_model, d_head, base):
        super().__init__()
        self.d_head = d_head
        self.n_heads = d_model // d_head
        self.qkv_proj = nn.Linear(d_model, d_model * 3, bias=False)
        self.pos_emb = RoPE1d(d_head // 4, base)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        n, l, _ = x.shape
        qkv = self.qkv_proj(x).view(n, l, 3, self.n_heads, self.d_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        theta = self.pos_emb(l)
        q = apply_rotary_emb(q, theta)
        k = apply_rotary_emb(k, theta)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_head)
        x = torch.matmul(torch.softmax(scores, dim=-1), v)
        x = x.transpose(1, 2).reshape(n, l, self.n_heads * self.d_head)
        return self.out_proj(x)


class SelfAttentionBlock(nn.Module):
    def __init__(self, d_model, d_head, base):
        super().__init__()
        self.norm = RMSNorm(d_model)
        self.attn = SelfAttention(d_model, d_head, base)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Level(nn.Module):
    def __init__(self, d_model, d_head, base):
        super().__init__()
        self.blocks = nn.ModuleList([SelfAttentionBlock(d_model, d_head, base)])
        self.out_norm = RMSNorm(d_model)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x)


def make_kdiff_level():
    torch.manual_seed(2105)
    model = Level(64, 16, 10000.0)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.scale.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_kdiff_level",
    "kind": "multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": 'k-diffusion image_transformer_v2 SelfAttentionBlock, 1-D RoPE on the first half of each head: correct',
}
