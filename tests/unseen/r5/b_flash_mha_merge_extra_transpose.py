"""flash-attn style MHA (Wqkv, inner SelfAttention, out_proj) as Block.mixer; bug: the merge transposes a context that is already (b, s, h, d)."""

import math

import torch
from einops import rearrange
from torch import nn


class SelfAttention(nn.Module):
    """Reference (non-flash) attention over a packed qkv of shape (B, S, 3, H, D)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv):
        seqlen = qkv.shape[1]
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if self.causal:
            fill = torch.finfo(scores.dtype).min
            causal_mask = torch.triu(torch.full((seqlen, seqlen), fill, device=scores.device), 1)
            scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        attention_drop = self.drop(attention)
        return torch.einsum("bhts,bshd->bthd", attention_drop, v)


class MHA(nn.Module):
    def __init__(self, embed_dim, num_heads, causal=False, qkv_proj_bias=True, out_proj_bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_proj_bias)
        self.inner_attn = SelfAttention(causal=causal)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias)

    def forward(self, x):
        qkv = self.Wqkv(x)
        qkv = rearrange(qkv, "... (three h d) -> ... three h d", three=3, d=self.head_dim)
        context = self.inner_attn(qkv)
        # context is (b, h, s, d): bring the heads next to d and flatten them
        b, s = x.shape[:2]
        return self.out_proj(context.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, mixer_cls, mlp_ratio=2):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.mixer = mixer_cls(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, hidden_states, residual=None):
        residual = hidden_states if residual is None else residual + hidden_states
        hidden_states = self.mixer(self.norm1(residual))
        residual = residual + hidden_states
        return residual + self.mlp(self.norm2(residual))


def make_block():
    return Block(20, mixer_cls=lambda dim: MHA(dim, num_heads=4, causal=True))


EXPECT = {
    "target": "make_block",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "output",
    "mistake": "heads_merge",
    "layer": "mixer",
    "style": "flash-attn MHA (Wqkv, SelfAttention with additive causal bias, out_proj) as Block.mixer; extra transpose before merging heads",
}
