"""Sana (NVlabs/Sana, diffusion/model/nets/sana_blocks.py) MultiHeadCrossAttention: q_linear on the
image tokens, one kv_linear on the caption tokens viewed as (1, B*M, 2, C) and unbound into k, v,
optional full-width q_norm / k_norm RMSNorm over d_model (Sana 1.5 qk_norm=True), the whole batch
packed into ONE sequence of B*N queries and B*M keys with a block-diagonal bias (xformers
BlockDiagonalMask.from_seqlens, rebuilt here in torch), memory_efficient_attention written out in torch
(default scale 1/sqrt(head_dim)), proj. The Sana block adds it residually (x = x + cross_attn(x, y)).
Target takes (hidden, context).

This file: one bug: a hand-written replacement for memory_efficient_attention forgets the default 1/sqrt(head_dim) scale."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, scale_factor=1.0, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) * scale_factor)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return (self._norm(x) * self.weight).type_as(x)


def block_diagonal_bias(q_seqlen, kv_seqlen, dtype, device):
    """BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen).materialize() for one packed sequence."""
    q_ids = torch.repeat_interleave(torch.arange(len(q_seqlen), device=device), torch.tensor(q_seqlen, device=device))
    k_ids = torch.repeat_interleave(torch.arange(len(kv_seqlen), device=device), torch.tensor(kv_seqlen, device=device))
    same = q_ids[:, None] == k_ids[None, :]
    bias = torch.zeros(same.shape, dtype=dtype, device=device)
    return bias.masked_fill(~same, float("-inf"))


def memory_efficient_attention(q, k, v, attn_bias=None, scale=None):
    """xformers.ops.memory_efficient_attention semantics: q, k, v are (1, L, H, D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    attn = q @ k.transpose(-2, -1)
    if attn_bias is not None:
        attn = attn + attn_bias
    attn = attn.softmax(dim=-1)
    return (attn @ v).transpose(1, 2)


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads, qk_norm=False):
        super().__init__()
        assert d_model % num_heads == 0
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.proj = nn.Linear(d_model, d_model)
        if qk_norm:
            self.q_norm = RMSNorm(d_model, scale_factor=1.0, eps=1e-6)
            self.k_norm = RMSNorm(d_model, scale_factor=1.0, eps=1e-6)
        else:
            self.q_norm = nn.Identity()
            self.k_norm = nn.Identity()

    def forward(self, x, cond, mask=None):
        # x: (B, N, C) image tokens; cond: (B, M, C) caption tokens
        B, N, C = x.shape
        M = cond.shape[1]
        first_dim = 1

        q = self.q_linear(x).view(first_dim, -1, C)
        kv = self.kv_linear(cond).view(first_dim, -1, 2, C)
        k, v = kv.unbind(2)
        q = self.q_norm(q).view(first_dim, -1, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(first_dim, -1, self.num_heads, self.head_dim)
        v = v.view(first_dim, -1, self.num_heads, self.head_dim)

        kv_lens = [k.shape[1] // B] * B if mask is None else mask
        attn_bias = block_diagonal_bias([N] * B, kv_lens, q.dtype, q.device)
        x = memory_efficient_attention(q, k, v, attn_bias=attn_bias)

        x = x.reshape(B, -1, C)
        return self.proj(x)


class SanaCrossBlock(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, qk_norm=True):
        super().__init__()
        self.cross_attn = MultiHeadCrossAttention(hidden_size, num_heads, qk_norm=qk_norm)

    def forward(self, x, y):
        return x + self.cross_attn(x, y)


def make_sana_cross():
    torch.manual_seed(2340)
    model = SanaCrossBlock()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_sana_cross",
    "kind": "cross",
    "ok": False,
    "layer": "cross_attn",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "Sana MultiHeadCrossAttention: manual attention q @ k^T without the scale",
}
