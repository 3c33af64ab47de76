"""mamba_ssm (state-spaces/mamba) `MHA` mixer, the attention layer of the Mamba-2 hybrids: one fused
`in_proj` for q and the kv pair, `rearrange`-style head split written with view, flash-attn style
`RotaryEmbedding` (cos/sin cache of rotary_dim/2 frequencies, `interleaved` flag, partial rotary_dim),
GQA by `torch.repeat_interleave` on the head axis, `F.scaled_dot_product_attention(is_causal=...)`,
`out_proj`; wrapped in mamba_ssm's `Block` (add-then-norm residual stream) inside a small MixerModel.

This file: one bug: the default softmax_scale is computed from rotary_emb_dim (8) instead of head_dim (16): scores scaled by 1/sqrt(8)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rstd * self.weight


def rotate_half(x, interleaved=False):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """x: (batch, seqlen, nheads, headdim); cos, sin: (seqlen, rotary_dim / 2)."""
    ro_dim = cos.shape[-1] * 2
    if interleaved:
        cos = cos.repeat_interleave(2, dim=-1)[:, None, :]
        sin = sin.repeat_interleave(2, dim=-1)[:, None, :]
    else:
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    x_ro = x[..., :ro_dim]
    return torch.cat([x_ro * cos + rotate_half(x_ro, interleaved) * sin, x[..., ro_dim:]], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interleaved=False):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _cos_sin(self, seqlen, offset, dtype, device):
        t = torch.arange(offset, offset + seqlen, dtype=torch.float64, device=device)
        freqs = torch.outer(t, self.inv_freq.to(device))
        return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)

    def forward(self, q, kv, seqlen_offset=0):
        """q: (batch, seqlen, nheads, headdim); kv: (batch, seqlen, 2, nheads_kv, headdim)."""
        cos, sin = self._cos_sin(q.shape[1], seqlen_offset, q.dtype, q.device)
        q = apply_rotary_emb_torch(q, cos, sin, self.interleaved)
        k = apply_rotary_emb_torch(kv[:, :, 0], cos, sin, self.interleaved)
        return q, torch.stack([k, kv[:, :, 1]], dim=2)


class MHA(nn.Module):
    """Multi-head self-attention and cross-attention"""

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, head_dim=None, qkv_proj_bias=True,
                 out_proj_bias=True, softmax_scale=None, causal=False, layer_idx=None, d_conv=0,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_interleaved=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.layer_idx = layer_idx
        self.d_conv = d_conv
        self.rotary_emb_dim = rotary_emb_dim
        self.softmax_scale = softmax_scale if softmax_scale is not None else rotary_emb_dim ** -0.5
        self.causal = causal
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        assert self.num_heads % self.num_heads_kv == 0, "num_heads must be divisible by num_heads_kv"
        if head_dim is None:
            assert self.embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads"
        self.head_dim = head_dim if head_dim is not None else self.embed_dim // num_heads
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        out_dim = self.head_dim * self.num_heads
        if self.rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(self.rotary_emb_dim, base=rotary_emb_base,
                                              interleaved=rotary_emb_interleaved)
        self.in_proj = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias)
        if self.d_conv > 0:
            self.conv1d = nn.Conv1d(qkv_dim, qkv_dim, kernel_size=self.d_conv, padding=self.d_conv - 1,
                                    groups=qkv_dim)
        self.out_proj = nn.Linear(out_dim, embed_dim, bias=out_proj_bias)

    def forward(self, x, inference_params=None):
        batch, seqlen, _ = x.shape
        qkv = self.in_proj(x)
        if self.d_conv > 0:
            qkv = self.conv1d(qkv.transpose(1, 2))[..., :seqlen].transpose(1, 2).contiguous()
        q, kv = qkv.split([self.num_heads * self.head_dim, 2 * self.num_heads_kv * self.head_dim], dim=-1)
        q = q.view(batch, seqlen, self.num_heads, self.head_dim)
        kv = kv.view(batch, seqlen, 2, self.num_heads_kv, self.head_dim)
        if self.rotary_emb_dim > 0:
            q, kv = self.rotary_emb(q, kv, seqlen_offset=0)
        k, v = kv.unbind(dim=-3)
        k = torch.repeat_interleave(k, dim=2, repeats=self.num_heads // self.num_heads_kv)
        v = torch.repeat_interleave(v, dim=2, repeats=self.num_heads // self.num_heads_kv)
        context = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal,
            scale=self.softmax_scale,
        ).transpose(1, 2)
        context = context.reshape(batch, seqlen, self.num_heads * self.head_dim)
        return self.out_proj(context)


class GatedMLP(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=False)
        self.fc2 = nn.Linear(hidden_features, in_features, bias=False)

    def forward(self, x):
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * F.silu(gate))


class Block(nn.Module):
    """mamba_ssm Block: Add -> Norm -> Mixer, returns (hidden_states, residual)."""

    def __init__(self, dim, mixer, mlp):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mixer = mixer
        self.norm2 = RMSNorm(dim)
        self.mlp = mlp

    def forward(self, hidden_states, residual=None):
        residual = hidden_states + residual if residual is not None else hidden_states
        hidden_states = self.mixer(self.norm(residual))
        residual = hidden_states + residual
        hidden_states = self.mlp(self.norm2(residual))
        return hidden_states, residual


class MixerModel(nn.Module):
    def __init__(self, d_model, attn_cfg):
        super().__init__()
        self.layers = nn.ModuleList(
            [Block(d_model, MHA(d_model, layer_idx=0, **attn_cfg), GatedMLP(d_model, 2 * d_model))]
        )
        self.norm_f = RMSNorm(d_model)

    def forward(self, hidden_states):
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual)
        return self.norm_f(hidden_states + residual)


def make_mamba_hybrid_attn():
    torch.manual_seed(2605)
    model = MixerModel(64, dict(num_heads=4, num_heads_kv=1, causal=True, rotary_emb_dim=8, rotary_emb_base=500000.0, rotary_emb_interleaved=False))
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_mamba_hybrid_attn',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.mixer',
 'stage': 'scaled_scores',
 'mistake': 'wrong_scale',
 'style': 'mamba_ssm MHA: softmax_scale defaulted to rotary_emb_dim ** -0.5 with partial rotary'}
