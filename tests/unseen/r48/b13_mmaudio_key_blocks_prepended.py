"""MMAudio (hkchengrex) multimodal DiT attention, as in its transformer_layers: a fused biased qkv
projection whose channels are laid out '(h d j)' (j = q/k/v innermost), per-head RMSNorm on queries
and keys, rotary on the audio latents applied before attention, bidirectional; SDPA or an eager
einsum core that walks the keys in blocks. The cross variant reads conditioning tokens (clip
features) as keys/values.

This file: one bug: each key block's scores are chunks.insert(0, ...) instead of append: for more than 4 keys the blocks come out in reverse order, scores sit at other keys' positions"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def compute_rope_rotations(length, dim, theta, device, dtype):
    """cos/sin tables laid out for adjacent pairs (x0, x1), (x2, x3), ...: each angle repeated twice."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    pos = torch.arange(length, dtype=torch.float64, device=device)
    angles = torch.outer(pos, freqs)
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = angles.sin().repeat_interleave(2, dim=-1)
    return cos.to(dtype), sin.to(dtype)


def rotate_pairs(x):
    x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x_odd, x_even), dim=-1).flatten(-2)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, rot):
    cos, sin = rot
    return x * cos + rotate_pairs(x) * sin


def block_attention(q, k, v, scale, block=4):
    """Eager core: scores computed one block of keys at a time, then softmax over all keys."""
    chunks = []
    for start in range(0, k.shape[-2], block):
        k_blk = k[..., start : start + block, :]
        chunks_scores = torch.einsum("bhid,bhjd->bhij", q, k_blk) * scale
        chunks.insert(0, chunks_scores)
    scores = torch.cat(chunks, dim=-1)
    weights = scores.softmax(dim=-1)
    return torch.einsum("bhij,bhjd->bhid", weights, v)


class SelfAttention(nn.Module):
    def __init__(self, dim, nheads, use_sdpa):
        super().__init__()
        self.dim = dim
        self.nheads = nheads
        self.head_dim = dim // nheads
        self.use_sdpa = use_sdpa
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def pre_attention(self, x, rot):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, self.nheads, self.head_dim, 3).unbind(-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(self.q_norm(q), rot)
        k = apply_rope(self.k_norm(k), rot)
        return q, k, v

    def forward(self, x, rot):
        q, k, v = self.pre_attention(x, rot)

        if self.use_sdpa:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = block_attention(q, k, v, self.head_dim ** -0.5)
        return out.transpose(1, 2).flatten(2)


class JointBlock(nn.Module):
    def __init__(self, dim, nheads, use_sdpa):
        super().__init__()
        self.pre_norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, nheads, use_sdpa)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim))

    def forward(self, x, rot):
        x = x + self.proj(self.attn(self.pre_norm(x), rot))
        return x + self.ffn(x)


class MMAudioLatentNet(nn.Module):
    def __init__(self, dim=64, nheads=2, theta=10000.0, use_sdpa=False):
        super().__init__()
        self.dim, self.nheads, self.theta = dim, nheads, theta
        self.blocks = nn.ModuleList([JointBlock(dim, nheads, use_sdpa)])
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, latent):
        rot = compute_rope_rotations(
            latent.shape[1], self.dim // self.nheads, self.theta, latent.device, latent.dtype
        )
        x = latent
        for block in self.blocks:
            x = block(x, rot)
        return self.final_norm(x)


def make_mmaudio_net():
    torch.manual_seed(4802)
    model = MMAudioLatentNet()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (RMSNorm, nn.LayerNorm)):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, nn.LayerNorm):
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_mmaudio_net',
 'kind': 'multihead',
 'ok': False,
 'layer': 'blocks.0.attn',
 'stage': 'scores',
 'mistake': 'wrong_key_index',
 'style': 'MMAudio (hkchengrex) (b13_mmaudio_key_blocks_prepended): (base c02) one bug: each key '
          "block's scores are chunks.insert(0, ...) instead of append: for more than 4 keys the "
          "blocks come out in reverse order, scores sit at other keys' positions"}
