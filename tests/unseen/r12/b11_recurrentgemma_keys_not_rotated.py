"""google-deepmind/recurrentgemma (Griffin) style LocalAttentionBlock inside a one-block model: multi-
query attention (proj_k/proj_v give a single head), heads via einops rearrange "... (n h) -> ... n h",
RoPE on the first half of each head only (apply_rope chunks the head into [rope | pass-through] and the
rope part into halves, max_wavelength 10_000) at the segment positions the model builds, logits by a
grouped einsum "b t n h, b s h -> b n t s" times head_dim**-0.5, a local causal mask built from
position comparisons (window of attention_window_size keys, the query included) applied with
torch.where(mask, logits, -1e30), and proj_final. The residual block pre-normalises with a Gemma-style
RMSNorm x * (1 + scale).

This file's one bug: recurrentgemma LocalAttentionBlock: apply_rope applied to the queries only, the
single key head stays unrotated."""

import dataclasses

import einops
import torch
import torch.nn.functional as F
from torch import nn

_MIN_LOGITS_VALUE = -1e30
_MAX_WAVELENGTH = 10_000


@dataclasses.dataclass
class GriffinConfig:
    width: int = 64
    num_heads: int = 4
    attention_window_size: int = 8
    num_blocks: int = 1


def apply_rope(inputs, positions, max_wavelength=_MAX_WAVELENGTH):
    x_rope, x = torch.chunk(inputs, 2, dim=-1)
    positions = positions.to(torch.float64)[..., None, None]
    freq_exponents = 2 * torch.arange(x_rope.shape[-1] // 2, dtype=torch.float64) / x_rope.shape[-1]
    timescale = max_wavelength**freq_exponents
    inv_frequencies = 1.0 / timescale
    sinusoid_imp = positions * inv_frequencies
    sin = torch.sin(sinusoid_imp).type_as(inputs)
    cos = torch.cos(sinusoid_imp).type_as(inputs)
    first_half, second_half = torch.chunk(x_rope, 2, dim=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return torch.cat([first_part, second_part, x], dim=-1)


def compute_forward_pass_mask(segment_pos, window_size):
    positions = torch.arange(segment_pos.shape[1], device=segment_pos.device)
    q_pos = positions[:, None]
    k_pos = positions[None, :]
    causal_mask = q_pos >= k_pos
    window_mask = q_pos - k_pos < window_size
    return (causal_mask & window_mask)[None].expand(segment_pos.shape[0], -1, -1)


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        var = torch.mean(torch.square(x), dim=-1, keepdim=True)
        normed_x = x * torch.rsqrt(var + self.eps)
        return normed_x * (self.scale + 1)


class LocalAttentionBlock(nn.Module):
    def __init__(self, width, num_heads, window_size):
        super().__init__()
        self.width = width
        self.num_heads = num_heads
        self.window_size = window_size
        self.head_dim = width // num_heads
        self.proj_q = nn.Linear(width, width, bias=False)
        self.proj_k = nn.Linear(width, self.head_dim, bias=False)
        self.proj_v = nn.Linear(width, self.head_dim, bias=False)
        self.proj_final = nn.Linear(width, width, bias=True)

    def forward(self, x, segment_pos):
        b, t, _ = x.shape
        queries = self.proj_q(x)
        keys = self.proj_k(x)
        values = self.proj_v(x)
        queries = einops.rearrange(queries, "... (n h) -> ... n h", n=self.num_heads)
        keys = einops.rearrange(keys, "... (n h) -> ... n h", n=1)
        values = einops.rearrange(values, "... (n h) -> ... n h", n=1)

        queries = apply_rope(queries, segment_pos)

        attn_mask = compute_forward_pass_mask(segment_pos, self.window_size)

        logits = torch.einsum("btnh,bsh->bnts", queries, keys[..., 0, :])
        logits = logits * self.head_dim**-0.5
        masked_logits = torch.where(
            attn_mask[:, None, :, :], logits, torch.tensor(_MIN_LOGITS_VALUE, dtype=logits.dtype)
        )
        probs = F.softmax(masked_logits, dim=-1).type_as(x)
        encoded = torch.einsum("bnts,bsh->btnh", probs, values[..., 0, :])
        encoded = einops.rearrange(encoded, "... n h -> ... (n h)", n=self.num_heads)
        return self.proj_final(encoded)


class ResidualBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.temporal_pre_norm = RMSNorm(config.width)
        self.temporal_block = LocalAttentionBlock(
            width=config.width,
            num_heads=config.num_heads,
            window_size=config.attention_window_size,
        )
        self.channel_pre_norm = RMSNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 3 * config.width),
            nn.GELU(approximate="tanh"),
            nn.Linear(3 * config.width, config.width),
        )

    def forward(self, x, segment_pos):
        raw_x = x
        x = self.temporal_pre_norm(raw_x)
        x = self.temporal_block(x, segment_pos)
        residual = x + raw_x
        x = self.channel_pre_norm(residual)
        return self.mlp(x) + residual


class Griffin(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([ResidualBlock(config) for _ in range(config.num_blocks)])
        self.final_norm = RMSNorm(config.width)

    def forward(self, x):
        b, t, _ = x.shape
        segment_pos = torch.arange(t, device=x.device)[None, :].expand(b, t)
        for block in self.blocks:
            x = block(x, segment_pos)
        return self.final_norm(x)


def make_griffin():
    torch.manual_seed(1203)
    model = Griffin(GriffinConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.scale.uniform_(-0.5, 0.5)
    return model.eval()


EXPECT = {
    "target": "make_griffin",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "blocks.0.temporal_block",
    "stage": "rotated_keys",
    "mistake": "rope_missing",
    "style": "recurrentgemma LocalAttentionBlock: apply_rope applied to the queries only, the single "
    "key head stays unrotated",
}
