"""NomicBERT style encoder block: fused Wqkv with bias split by rearrange into
(three, heads, dim), rotary with base 1000 over the full head (non-interleaved),
non-causal, post-norm (LayerNorm after the residual) as in BERT.
"""

import math

import torch
from einops import rearrange
from torch import nn


class NomicBertRotary(nn.Module):
    def __init__(self, dim, base=1000.0):
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, qkv, seqlen_offset=0):
        t = qkv.shape[1]
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        pos = torch.arange(seqlen_offset, seqlen_offset + t, dtype=torch.float64)
        freqs = torch.outer(pos, inv_freq)
        cos, sin = freqs.cos().to(qkv.dtype), freqs.sin().to(qkv.dtype)
        q, k, v = qkv.unbind(2)

        def rot(x):
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2 :]
            c, s = cos[None, :, None, :], sin[None, :, None, :]
            return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

        return torch.stack([rot(q), rot(k), v], dim=2)


class NomicBertAttention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.Wqkv = nn.Linear(dim, 3 * dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)
        self.rotary_emb = NomicBertRotary(self.head_dim, base=1000.0)
        self.norm_factor = math.sqrt(self.head_dim)

    def forward(self, hidden_states, attention_mask=None):
        qkv = self.Wqkv(hidden_states)
        qkv = rearrange(qkv, "b s (three h d) -> b s three h d", three=3, d=self.head_dim)
        qkv = self.rotary_emb(qkv)
        q, k, v = qkv.permute(0, 3, 2, 1, 4).unbind(dim=2)  # (b, h, s, d)
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.norm_factor
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = scores.softmax(dim=-1)
        ctx = torch.matmul(probs, v)
        ctx = rearrange(ctx, "b h s d -> b s (h d)")
        return self.out_proj(ctx)


class NomicBertBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = NomicBertAttention()
        self.norm1 = nn.LayerNorm(64, eps=1e-12)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        pad = torch.ones(b, t)
        ext = (1.0 - pad[:, None, None, :].to(hidden_states.dtype)) * torch.finfo(
            hidden_states.dtype
        ).min
        return self.norm1(hidden_states + self.attn(hidden_states, ext))


def make_nomic_block():
    torch.manual_seed(7)
    blk = NomicBertBlock()
    with torch.no_grad():
        blk.norm1.weight.uniform_(0.5, 1.5)
    return blk


EXPECT = {
    "target": "make_nomic_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "NomicBERT (contrastors / nomic-bert-2048 remote code): fused Wqkv rearranged '(three h d)', "
    "non-interleaved rotary base 1000 applied inside the packed qkv, post-norm block, extended padding mask",
}
