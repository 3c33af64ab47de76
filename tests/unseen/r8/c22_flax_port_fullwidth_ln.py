"""Torch port of a Flax/JAX-style decoder attention (DenseGeneral-like einsum projections
stored as (in, heads, head_dim) kernels) with a full-width LayerNorm QK norm: queries
and keys are normalised over all heads*head_dim features before the head split (as in
OLMo-1's attention_layer_norm), GQA 8 query heads over 4 kv heads, rotate_half rotary
with base 25000, causal via an additive bias matrix.
"""

import torch
from torch import nn


class DenseGeneral(nn.Module):
    def __init__(self, features_in, heads, head_dim):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(features_in, heads, head_dim) * features_in**-0.5)

    def forward(self, x):
        return torch.einsum("btd,dhk->bthk", x, self.kernel)


class FlaxPortAttention(nn.Module):
    def __init__(self, d_model=64, heads=8, kv_heads=4, head_dim=8, rope_base=25000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_base = (
            heads,
            kv_heads,
            head_dim,
            rope_base,
        )
        self.query = DenseGeneral(d_model, heads, head_dim)
        self.key = DenseGeneral(d_model, kv_heads, head_dim)
        self.value = DenseGeneral(d_model, kv_heads, head_dim)
        self.out_kernel = nn.Parameter(
            torch.randn(heads, head_dim, d_model) * (heads * head_dim) ** -0.5
        )
        self.q_ln = nn.LayerNorm(heads * head_dim, eps=1e-5)
        self.k_ln = nn.LayerNorm(kv_heads * head_dim, eps=1e-5)

    def _rope(self, x, positions):
        half = self.head_dim // 2
        fraction = 2 * torch.arange(half, dtype=x.dtype) / self.head_dim
        timescale = self.rope_base**fraction
        sinusoid = positions[..., None].to(x.dtype) / timescale  # (b, t, half)
        sin, cos = torch.sin(sinusoid)[:, :, None], torch.cos(sinusoid)[:, :, None]
        first, second = x[..., :half], x[..., half:]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def forward(self, x, positions, bias):
        b, t, _ = x.shape
        q = self.query(x)
        k = self.key(x)
        v = self.value(x)
        q = self.q_ln(q.reshape(b, t, -1)).reshape(b, t, self.heads, self.head_dim)
        k = self.k_ln(k.reshape(b, t, -1)).reshape(b, t, self.kv_heads, self.head_dim)
        q = self._rope(q, positions)
        k = self._rope(k, positions)
        q = q.reshape(b, t, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        logits = torch.einsum("btkgd,bskd->bkgts", q, k) * self.head_dim**-0.5
        logits = logits + bias[:, None, None]
        w = torch.softmax(logits, dim=-1)
        ctx = torch.einsum("bkgts,bskd->btkgd", w, v).reshape(b, t, self.heads, self.head_dim)
        return torch.einsum("bthd,hdm->btm", ctx, self.out_kernel)


class FlaxPortBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_attention_norm = nn.LayerNorm(64)
        self.attention = FlaxPortAttention()

    def forward(self, x):
        b, t, _ = x.shape
        positions = torch.arange(t)[None].expand(b, t)
        causal = positions[:, :, None] >= positions[:, None, :]
        bias = torch.where(causal, 0.0, -1e10).to(x.dtype)
        return x + self.attention(self.pre_attention_norm(x), positions, bias)


def make_flax_port_block():
    torch.manual_seed(22)
    blk = FlaxPortBlock()
    with torch.no_grad():
        for n in (blk.pre_attention_norm, blk.attention.q_ln, blk.attention.k_ln):
            n.weight.copy_(torch.rand(n.weight.shape) + 0.4)
            n.bias.copy_(torch.rand(n.bias.shape) * 0.4 - 0.2)
    return blk


EXPECT = {
    "target": "make_flax_port_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attention",
    "structure": {
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 25000},
        "qk_norm": "full",
        "window": None,
        "bias": None,
    },
    "style": "torch port of a Flax decoder (DenseGeneral (in, heads, head_dim) kernels, einsum 'btkgd,bskd->bkgts' "
    "grouped layout, timescale-form rotary on halves), full-width LayerNorm q/k norm (OLMo-1 "
    "attention_layer_norm convention), additive -1e10 causal bias",
}
