"""google-deepmind/recurrentgemma (torch) Griffin, with every residual block an attention block.

Griffin: embedder (input embedding x sqrt(width)), blocks.N = ResidualBlock(temporal_pre_norm,
temporal_block = LocalAttentionBlock, channel_pre_norm, mlp_block = gated GELU), final_norm; RMSNorm
with a (1 + scale) gain.  LocalAttentionBlock: proj_q / proj_k / proj_v / proj_final (final with bias),
MQA (4 query heads, 1 kv head, head 16), rotary on the first half of each head only (rotate-half within
that slice, max_wavelength 1e4), queries scaled by 1/sqrt(head_dim) before the product, and a local
causal mask of `window_size` = config.attention_window_size = 5 keys (the query included).
Slip: block 2's LocalAttentionBlock was built with `window_size=None` by the checkpoint converter (the
config value is read only for blocks whose type string was "local"), so its mask is plain causal.
No cache.
"""
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["blocks.0.temporal_block", "blocks.1.temporal_block", "blocks.2.temporal_block"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "blocks.2.temporal_block",
    "stage": "masked_scores",
    "mistake": "window_missing",
    "style": "recurrentgemma Griffin torch: blocks.N.temporal_block LocalAttentionBlock, MQA 4/1, rotary on half "
    "of each head, (1+scale) RMSNorm, window 5 from config; block 2 built without its window",
}


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        var = torch.mean(torch.square(x), dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * (self.scale + 1)


def apply_rope(inputs, positions, max_wavelength=10000):
    x_rope, x = torch.chunk(inputs, 2, dim=-1)
    positions = positions[..., None, None].double()  # (b, t, 1, 1)
    freq_exponents = 2 * torch.arange(x_rope.shape[-1] // 2, dtype=torch.float64) / x_rope.shape[-1]
    timescale = max_wavelength ** freq_exponents
    inv_frequencies = 1.0 / timescale
    sinusoid_imp = positions * inv_frequencies
    sin = torch.sin(sinusoid_imp).to(inputs.dtype)
    cos = torch.cos(sinusoid_imp).to(inputs.dtype)
    first_half, second_half = torch.chunk(x_rope, 2, dim=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return torch.cat([first_part, second_part, x], dim=-1)


class LocalAttentionBlock(nn.Module):
    def __init__(self, width, num_heads, window_size):
        super().__init__()
        self.width, self.num_heads = width, num_heads
        self.head_dim = width // num_heads
        self.window_size = window_size
        self.proj_q = nn.Linear(width, width, bias=False)
        self.proj_k = nn.Linear(width, self.head_dim, bias=False)
        self.proj_v = nn.Linear(width, self.head_dim, bias=False)
        self.proj_final = nn.Linear(width, width, bias=True)

    def forward(self, x, segment_pos):
        b, t, _ = x.shape
        queries = self.proj_q(x).view(b, t, self.num_heads, self.head_dim)
        keys = self.proj_k(x).view(b, t, 1, self.head_dim)
        values = self.proj_v(x).view(b, t, 1, self.head_dim)
        queries = apply_rope(queries, segment_pos)
        keys = apply_rope(keys, segment_pos)
        logits = torch.einsum("bthd,bshd->bhts", queries * self.head_dim ** -0.5, keys)
        q_pos = segment_pos[:, :, None]
        k_pos = segment_pos[:, None, :]
        visible = k_pos <= q_pos
        if self.window_size is not None:
            visible = visible & (k_pos > q_pos - self.window_size)
        logits = logits.masked_fill(~visible[:, None], torch.finfo(logits.dtype).min)
        probs = F.softmax(logits, dim=-1)
        encoded = torch.einsum("bhts,bshd->bthd", probs, values).reshape(b, t, self.width)
        return self.proj_final(encoded)


class MLPBlock(nn.Module):
    def __init__(self, width, expanded):
        super().__init__()
        self.ffw_up = nn.Linear(width, 2 * expanded)
        self.ffw_down = nn.Linear(expanded, width)

    def forward(self, x):
        gate, up = self.ffw_up(x).chunk(2, dim=-1)
        return self.ffw_down(F.gelu(gate, approximate="tanh") * up)


class ResidualBlock(nn.Module):
    def __init__(self, config, block_type):
        super().__init__()
        self.temporal_pre_norm = RMSNorm(config.width)
        window = config.attention_window_size if block_type == "local" else None
        self.temporal_block = LocalAttentionBlock(config.width, config.num_heads, window)
        self.channel_pre_norm = RMSNorm(config.width)
        self.mlp_block = MLPBlock(config.width, config.mlp_expanded_width)

    def forward(self, x, segment_pos):
        x = x + self.temporal_block(self.temporal_pre_norm(x), segment_pos)
        return x + self.mlp_block(self.channel_pre_norm(x))


class Griffin(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedder = nn.Embedding(config.vocab_size, config.width)
        # converter wrote the last block's type as "attention" instead of "local"
        self.blocks = nn.ModuleList([ResidualBlock(config, bt) for bt in config.block_types])
        self.final_norm = RMSNorm(config.width)

    def forward(self, tokens):
        b, t = tokens.shape
        segment_pos = torch.arange(t, device=tokens.device)[None].expand(b, t)
        x = self.embedder(tokens) * math.sqrt(self.config.width)
        for block in self.blocks:
            x = block(x, segment_pos)
        x = self.final_norm(x)
        return x @ self.embedder.weight.t()


def make_model():
    torch.manual_seed(1308)
    config = SimpleNamespace(vocab_size=96, width=64, num_heads=4, mlp_expanded_width=128,
                             attention_window_size=5, block_types=("local", "local", "attention"))
    model = Griffin(config)
    with torch.no_grad():
        model.embedder.weight.mul_(0.125)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(0.2 * torch.randn_like(m.scale))
    return model.eval()
