"""MDLM (kuleshov-group/mdlm, models/dit.py; the same DiT is reused by BD3-LMs) style block:
DDiTBlock with a fused attn_qkv rearranged 'b s (three h d) -> b s three h d', a Rotary module
whose cos/sin caches cover q, k and v at once (the v slice filled with cos 1 / sin 0 so the
rotation is the identity on values), rotate_half application in the torchscript fallback,
a flash_attn_varlen_qkvpacked_func-style call on the packed (b s) tokens with cu_seqlens
(here a plain-torch varlen fallback), attn_out, and adaLN modulation from a fixed
conditioning vector (sigma embedding). MDLM attends bidirectionally; its AR baseline uses the
same block with causal=True.

This file: one bug: the varlen output is merged '(b s) h d -> b s (d h)'."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x, seq_dim=1):
        seq_len = x.shape[seq_dim]
        if seq_len != self.seq_len_cached:
            self.seq_len_cached = seq_len
            t = torch.arange(x.shape[seq_dim], device=x.device, dtype=torch.float64)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq.clone())
            emb = torch.cat((freqs, freqs), dim=-1)
            # dims are: batch, seq_len, qkv, head, dim
            self.cos_cached = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
            self.sin_cached = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
            # This makes the transformation on v an identity.
            self.cos_cached[:, :, 2, :, :].fill_(1.0)
            self.sin_cached[:, :, 2, :, :].fill_(0.0)
        return self.cos_cached, self.sin_cached


def apply_rotary_pos_emb_torchscript(qkv, cos, sin):
    return (qkv * cos) + (rotate_half(qkv) * sin)


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones([dim]))
        self.dim = dim

    def forward(self, x):
        x = F.layer_norm(x, [self.dim])
        return x * self.weight[None, None, :]


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, causal=False):
    """CPU stand-in for flash-attn's varlen kernel: qkv is (total, 3, h, d); each
    [cu_seqlens[i], cu_seqlens[i+1]) range is one independent sequence."""
    out = torch.empty_like(qkv[:, 0])
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        q, k, v = qkv[lo:hi].unbind(dim=1)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # h, s, d
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
        out[lo:hi] = o.transpose(0, 1)
    return out


class DDiTBlock(nn.Module):
    def __init__(self, dim, n_heads, cond_dim, mlp_ratio=2, causal=False):
        super().__init__()
        self.n_heads = n_heads
        self.causal = causal
        self.norm1 = LayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.norm2 = LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim, bias=True),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * dim, dim, bias=True),
        )
        self.adaLN_modulation = nn.Linear(cond_dim, 6 * dim, bias=True)

    def forward(self, x, rotary_cos_sin, c):
        batch_size, seq_len = x.shape[0], x.shape[1]
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) = self.adaLN_modulation(c)[
            :, None
        ].chunk(6, dim=2)

        x_skip = x
        x = modulate(self.norm1(x), shift_msa, scale_msa)
        qkv = self.attn_qkv(x)
        qkv = rearrange(qkv, "b s (three h d) -> b s three h d", three=3, h=self.n_heads)
        cos, sin = rotary_cos_sin
        qkv = apply_rotary_pos_emb_torchscript(qkv, cos.to(qkv.dtype), sin.to(qkv.dtype))
        qkv = rearrange(qkv, "b s ... -> (b s) ...")
        cu_seqlens = torch.arange(0, (batch_size + 1) * seq_len, step=seq_len, dtype=torch.int32, device=qkv.device)
        x = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, seq_len, 0.0, causal=self.causal)
        x = rearrange(x, "(b s) h d -> b s (d h)", b=batch_size)

        x = x_skip + gate_msa * self.attn_out(x)
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=32):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=t.dtype) / half)
        args = t[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class DIT(nn.Module):
    def __init__(self, hidden_size=64, n_heads=4, cond_dim=32, causal=False):
        super().__init__()
        self.sigma_map = TimestepEmbedder(cond_dim)
        self.rotary_emb = Rotary(hidden_size // n_heads)
        self.blocks = nn.ModuleList([DDiTBlock(hidden_size, n_heads, cond_dim, causal=causal)])
        self.register_buffer("sigma", torch.tensor([0.37]), persistent=False)

    def forward(self, x):
        c = F.silu(self.sigma_map(self.sigma.to(x.dtype))).expand(x.shape[0], -1)
        rotary_cos_sin = self.rotary_emb(x)
        for block in self.blocks:
            x = block(x, rotary_cos_sin, c)
        return x


def make_mdlm_dit():
    torch.manual_seed(3147)
    model = DIT()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
        for blk in model.blocks:
            # a trained model's adaLN is not the zero init: give the gates a real value
            blk.adaLN_modulation.weight.normal_(0.0, 0.2)
            blk.adaLN_modulation.bias.uniform_(0.5, 1.0)
    return model.eval()


EXPECT = {'target': 'make_mdlm_dit',
 'kind': 'multihead',
 'ok': False,
 'layer': 'blocks.0',
 'stage': 'output',
 'mistake': 'heads_merge',
 'style': "MDLM DDiTBlock (models/dit.py): rearrange '(b s) h d -> b s (d h)': features "
          'interleaved across heads before attn_out'}
