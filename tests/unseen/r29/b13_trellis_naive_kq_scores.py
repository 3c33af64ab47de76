"""TRELLIS (microsoft/TRELLIS `trellis/modules/attention/modules.py` + `full_attn.py`) dense
MultiHeadAttention: `to_qkv` reshaped to [N, L, 3, H, C] (self) or `to_q` + `to_kv` [N, L, 2, H, C]
(cross), optional `RotaryPositionEmbedder` (complex phases, adjacent pairs), optional
`MultiHeadRMSNorm` (F.normalize * gamma[heads, dim] * sqrt(dim)), backend-switched
`scaled_dot_product_attention` ('sdpa' or 'naive'), `to_out`; non-causal. Self-attention sits in an
adaLN `ModulatedTransformerBlock`; cross-attention in the norm2/cross_attn step of the cross block.

This file: naive backend computes k @ q^T (square for self-attention, so the shapes still fit)."""

import math
from typing import Literal, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

BACKEND = "naive"  # trellis.modules.attention: 'xformers' | 'flash_attn' | 'sdpa' | 'naive'


def _naive_sdpa(q, k, v):
    """q, k, v: [N, L, H, C] -> [N, L, H, C] (the 'naive' backend)."""
    q = q.permute(0, 2, 1, 3)  # [N, H, L, C]
    k = k.permute(0, 2, 1, 3)
    v = v.permute(0, 2, 1, 3)
    scale_factor = 1 / math.sqrt(q.size(-1))
    attn_weight = k @ q.transpose(-2, -1) * scale_factor
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight @ v
    return out.permute(0, 2, 1, 3)


def scaled_dot_product_attention(*args):
    """Dense full attention. Accepts (qkv) [N, L, 3, H, C], (q, kv) with kv [N, L, 2, H, C],
    or (q, k, v) [N, L, H, C]."""
    if len(args) == 1:
        q, k, v = args[0].unbind(dim=2)
    elif len(args) == 2:
        q = args[0]
        k, v = args[1].unbind(dim=2)
    else:
        q, k, v = args
    if BACKEND == "naive":
        return _naive_sdpa(q, k, v)
    q = q.permute(0, 2, 1, 3)
    k = k.permute(0, 2, 1, 3)
    v = v.permute(0, 2, 1, 3)
    out = F.scaled_dot_product_attention(q, k, v)
    return out.permute(0, 2, 1, 3)


def windowed_attention(qkv, window_size, shift):
    """Non-overlapping windows along the serialized token axis, offset by `shift`."""
    N, L = qkv.shape[:2]
    bounds = [0] + list(range(shift if shift else window_size, L, window_size)) + [L]
    bounds = sorted(set(b for b in bounds if 0 <= b <= L))
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        outs.append(scaled_dot_product_attention(qkv[:, lo:hi]))
    return torch.cat(outs, dim=1)


class MultiHeadRMSNorm(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.normalize(x, dim=-1) * self.gamma * self.scale).to(x.dtype)


class RotaryPositionEmbedder(nn.Module):
    def __init__(self, hidden_size: int, in_channels: int = 3):
        super().__init__()
        assert hidden_size % 2 == 0, "Hidden size must be divisible by 2"
        self.hidden_size = hidden_size
        self.in_channels = in_channels
        self.freq_dim = hidden_size // in_channels // 2
        freqs = torch.arange(self.freq_dim, dtype=torch.float64) / self.freq_dim
        self.freqs = 1.0 / (10000 ** freqs)

    def _get_phases(self, indices: torch.Tensor) -> torch.Tensor:
        phases = torch.outer(indices.to(torch.float64), self.freqs.to(indices.device))
        return torch.polar(torch.ones_like(phases), phases)

    def _rotary_embedding(self, x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
        x_complex = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
        x_rotated = x_complex * phases
        return torch.view_as_real(x_rotated).reshape(*x_rotated.shape[:-1], -1).to(x.dtype)

    def forward(self, q, k, indices=None):
        """q, k: [..., L, H, C]; indices: [..., L, in_channels] integer positions."""
        if indices is None:
            indices = torch.arange(q.shape[-3], device=q.device)[:, None]
        phases = self._get_phases(indices.reshape(-1)).reshape(*indices.shape[:-1], -1)
        if phases.shape[-1] < self.hidden_size // 2:
            pad = self.hidden_size // 2 - phases.shape[-1]
            phases = torch.cat(
                [phases, torch.polar(torch.ones(*phases.shape[:-1], pad, dtype=torch.float64),
                                     torch.zeros(*phases.shape[:-1], pad, dtype=torch.float64))],
                dim=-1,
            )
        phases = phases.unsqueeze(-2)  # broadcast over heads
        return self._rotary_embedding(q, phases), self._rotary_embedding(k, phases)


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        channels: int,
        num_heads: int,
        ctx_channels: Optional[int] = None,
        type: Literal["self", "cross"] = "self",
        attn_mode: Literal["full", "windowed"] = "full",
        window_size: Optional[int] = None,
        shift_window: Optional[Tuple[int, int, int]] = None,
        qkv_bias: bool = True,
        use_rope: bool = False,
        qk_rms_norm: bool = False,
    ):
        super().__init__()
        assert channels % num_heads == 0
        self.channels = channels
        self.head_dim = channels // num_heads
        self.ctx_channels = ctx_channels if ctx_channels is not None else channels
        self.num_heads = num_heads
        self._type = type
        self.attn_mode = attn_mode
        self.window_size = window_size
        self.shift_window = shift_window
        self.use_rope = use_rope
        self.qk_rms_norm = qk_rms_norm

        if self._type == "self":
            self.to_qkv = nn.Linear(channels, channels * 3, bias=qkv_bias)
        else:
            self.to_q = nn.Linear(channels, channels, bias=qkv_bias)
            self.to_kv = nn.Linear(self.ctx_channels, channels * 2, bias=qkv_bias)

        if self.qk_rms_norm:
            self.q_rms_norm = MultiHeadRMSNorm(self.head_dim, num_heads)
            self.k_rms_norm = MultiHeadRMSNorm(self.head_dim, num_heads)

        self.to_out = nn.Linear(channels, channels)

        if use_rope:
            self.rope = RotaryPositionEmbedder(self.head_dim, in_channels=1)

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None, indices=None):
        B, L, C = x.shape
        if self._type == "self":
            qkv = self.to_qkv(x)
            qkv = qkv.reshape(B, L, 3, self.num_heads, -1)
            if self.use_rope:
                q, k, v = qkv.unbind(dim=2)
                q, k = self.rope(q, k, indices)
                qkv = torch.stack([q, k, v], dim=2)
            if self.attn_mode == "full":
                if self.qk_rms_norm:
                    q, k, v = qkv.unbind(dim=2)
                    q = self.q_rms_norm(q)
                    k = self.k_rms_norm(k)
                    h = scaled_dot_product_attention(q, k, v)
                else:
                    h = scaled_dot_product_attention(qkv)
            elif self.attn_mode == "windowed":
                h = windowed_attention(qkv, self.window_size, self.shift_window[0] if self.shift_window else 0)
        else:
            Lkv = context.shape[1]
            q = self.to_q(x)
            kv = self.to_kv(context)
            q = q.reshape(B, L, self.num_heads, -1)
            kv = kv.reshape(B, Lkv, 2, self.num_heads, -1)
            if self.qk_rms_norm:
                q = self.q_rms_norm(q)
                k, v = kv.unbind(dim=2)
                k = self.k_rms_norm(k)
                h = scaled_dot_product_attention(q, k, v)
            else:
                h = scaled_dot_product_attention(q, kv)
        h = h.reshape(B, L, -1)
        h = self.to_out(h)
        return h


class LayerNorm32(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class FeedForwardNet(nn.Module):
    def __init__(self, channels: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(channels, int(channels * mlp_ratio)),
            nn.GELU(approximate="tanh"),
            nn.Linear(int(channels * mlp_ratio), channels),
        )

    def forward(self, x):
        return self.mlp(x)


class ModulatedTransformerBlock(nn.Module):
    """adaLN-modulated self-attention block (trellis.modules.transformer.modulated)."""

    def __init__(self, channels, num_heads, mlp_ratio=4.0, attn_mode="full", window_size=None,
                 shift_window=None, use_rope=False, qk_rms_norm=False, qkv_bias=True):
        super().__init__()
        self.norm1 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.attn = MultiHeadAttention(
            channels, num_heads=num_heads, attn_mode=attn_mode, window_size=window_size,
            shift_window=shift_window, qkv_bias=qkv_bias, use_rope=use_rope, qk_rms_norm=qk_rms_norm,
        )
        self.mlp = FeedForwardNet(channels, mlp_ratio=mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))

    def forward(self, x, mod):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(mod).chunk(6, dim=1)
        h = self.norm1(x)
        h = h * (1 + scale_msa.unsqueeze(1)) + shift_msa.unsqueeze(1)
        h = self.attn(h)
        x = x + h * gate_msa.unsqueeze(1)
        h = self.norm2(x)
        h = h * (1 + scale_mlp.unsqueeze(1)) + shift_mlp.unsqueeze(1)
        return x + self.mlp(h) * gate_mlp.unsqueeze(1)


class CrossAttentionStage(nn.Module):
    """The cross-attention step of ModulatedTransformerCrossBlock: norm2 (affine), cross_attn, residual."""

    def __init__(self, channels, ctx_channels, num_heads, qk_rms_norm_cross=False, qkv_bias=True):
        super().__init__()
        self.norm2 = LayerNorm32(channels, elementwise_affine=True, eps=1e-6)
        self.cross_attn = MultiHeadAttention(
            channels, ctx_channels=ctx_channels, num_heads=num_heads, type="cross",
            attn_mode="full", qkv_bias=qkv_bias, qk_rms_norm=qk_rms_norm_cross,
        )

    def forward(self, x, context):
        return x + self.cross_attn(self.norm2(x), context)


class SelfStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.t_mod = nn.Parameter(torch.randn(1, 64) * 0.5)  # a fixed timestep's conditioning vector
        self.blocks = nn.ModuleList([
            ModulatedTransformerBlock(64, 8, attn_mode="full", window_size=None,
                                      shift_window=None, use_rope=False, qk_rms_norm=True)
        ])

    def forward(self, x):
        mod = self.t_mod.expand(x.shape[0], -1).to(x.dtype)
        for block in self.blocks:
            x = block(x, mod)
        return x


class CrossStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CrossAttentionStage(64, 64, 8, qk_rms_norm_cross=True)])

    def forward(self, x, context):
        for block in self.blocks:
            x = block(x, context)
        return x


def make_trellis_self_block():
    torch.manual_seed(2925)
    model = SelfStack()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, MultiHeadRMSNorm):
                mod.gamma.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.LayerNorm) and mod.elementwise_affine:
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
        # adaLN is zero-initialised in TRELLIS; give it small trained-looking values instead
        for mod in model.modules():
            if isinstance(mod, ModulatedTransformerBlock):
                mod.adaLN_modulation[1].weight.normal_(0.0, 0.05)
                mod.adaLN_modulation[1].bias.normal_(0.0, 0.2)
    return model.eval()


EXPECT = {'target': 'make_trellis_self_block',
 'kind': 'multihead',
 'ok': False,
 'layer': 'blocks.0.attn',
 'stage': 'scores',
 'mistake': 'scores_transposed',
 'style': 'TRELLIS MultiHeadAttention (modules.py/full_attn.py): naive backend computes k @ q^T '
          '(square for self-attention, so the shapes still fit)'}
