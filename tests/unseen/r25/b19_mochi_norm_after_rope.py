"""Genmo Mochi 1 (genmoai/mochi, asymm_attention / AsymmetricAttention, visual stream only): fused
qkv_x projection viewed (B, L, 3, H, D) and unbound, per-head q_norm_x / k_norm_x RMSNorm with learned
weights, real-valued adjacent-pair rotary (apply_rotary_emb_qk_real on even/odd channels, 1-D positions,
base 10000, tables built in float64), tokens packed along one axis with cu_seqlens and attended segment
by segment (the torch stand-in for flash_attn_varlen_func), proj_x with bias; pre-norm RMSNorm and
residual in the block. Non-causal (a diffusion transformer).

This file: one bug: the per-head RMSNorms (non-uniform gains) are applied after the rotation."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        x_fp = x
        return x_fp * torch.rsqrt(x_fp.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(num_tokens, head_dim, num_heads, dtype, device, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    pos = torch.arange(num_tokens, dtype=torch.float64, device=device)
    angles = torch.outer(pos, freqs)[:, None, :].expand(num_tokens, num_heads, head_dim // 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary_emb_qk_real(xqk, freqs_cos, freqs_sin):
    """xqk: (B, L, H, D); freqs_cos/sin: (L, H, D // 2)."""
    xqk_even = xqk[..., 0::2]
    xqk_odd = xqk[..., 1::2]
    cos_part = (xqk_even * freqs_cos - xqk_odd * freqs_sin).type_as(xqk)
    sin_part = (xqk_even * freqs_sin + xqk_odd * freqs_cos).type_as(xqk)
    return torch.stack([cos_part, sin_part], dim=-1).flatten(-2)


def varlen_attention(q, k, v, cu_seqlens, scale):
    """q, k, v: (total_tokens, H, D) packed; attend within each [cu_seqlens[i], cu_seqlens[i+1])."""
    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


class AsymmetricAttention(nn.Module):
    def __init__(self, dim_x, num_heads=4, qkv_bias=False, out_bias=True):
        super().__init__()
        self.dim_x = dim_x
        self.num_heads = num_heads
        self.head_dim = dim_x // num_heads
        self.qkv_x = nn.Linear(dim_x, 3 * dim_x, bias=qkv_bias)
        self.q_norm_x = RMSNorm(self.head_dim)
        self.k_norm_x = RMSNorm(self.head_dim)
        self.proj_x = nn.Linear(dim_x, dim_x, bias=out_bias)

    def forward(self, x, rope_cos, rope_sin):
        B, L, _ = x.shape
        qkv = self.qkv_x(x).view(B, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(2)
        q = apply_rotary_emb_qk_real(q, rope_cos, rope_sin)
        k = apply_rotary_emb_qk_real(k, rope_cos, rope_sin)
        q = self.q_norm_x(q)
        k = self.k_norm_x(k)
        # pack the batch along one token axis, as the varlen kernel expects
        q, k, v = (t.reshape(B * L, self.num_heads, self.head_dim) for t in (q, k, v))
        cu_seqlens = torch.arange(0, B * L + 1, L, device=x.device)
        out = varlen_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        out = out.view(B, L, self.dim_x)
        return self.proj_x(out)


class AsymmetricJointBlock(nn.Module):
    def __init__(self, hidden_size_x=64, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.norm_x = RMSNorm(hidden_size_x)
        self.attn = AsymmetricAttention(hidden_size_x, num_heads=num_heads)
        self.norm_mlp = RMSNorm(hidden_size_x)
        self.mlp_x = nn.Sequential(nn.Linear(hidden_size_x, 2 * hidden_size_x), nn.GELU(approximate="tanh"),
                                   nn.Linear(2 * hidden_size_x, hidden_size_x))

    def forward(self, x):
        L = x.shape[1]
        cos, sin = rope_cos_sin(L, self.attn.head_dim, self.num_heads, x.dtype, x.device)
        x = x + self.attn(self.norm_x(x), cos, sin)
        return x + self.mlp_x(self.norm_mlp(x))


def make_mochi_block():
    torch.manual_seed(2552)
    block = AsymmetricJointBlock()
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {
    "target": "make_mochi_block",
    "kind": "multihead",
    "ok": False,
    "layer": "attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "Genmo Mochi AsymmetricAttention: q_norm_x/k_norm_x after apply_rotary_emb_qk_real",
}
