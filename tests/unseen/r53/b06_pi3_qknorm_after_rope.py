"""Pi3 (yyfz) visual-geometry decoder attention (DINOv2/timm-style Attention) (per-head LayerNorm q_norm/k_norm then adjacent-pair rotary (base 100) on the token index, eager softmax).

This file: one bug: q_norm/k_norm moved below the rotary call: the per-head LayerNorm (non-uniform gain and bias) acts on rotated heads."""

import torch
from torch import nn
from torch.nn import functional as F


class Pi3DecoderConfig:
    dim = 64
    num_heads = 8
    qk_norm = True
    use_rope = True
    rope_freq = 100.0
    fused_attn = False
    mlp_ratio = 2.0
    tokens_per_frame = 4  # patch tokens per view in the frame-attention layers


def rotate_every_two(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RotaryPositionEmbedding1D(nn.Module):
    """Rotary embedding on adjacent feature pairs (complex-number layout); tables built in float64
    at every call."""

    def __init__(self, freq=100.0):
        super().__init__()
        self.base = freq

    def forward(self, tokens, positions):
        dim = tokens.size(-1)
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=tokens.device) / dim)
        )
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        cos = angles.cos().repeat_interleave(2, dim=-1).to(tokens.dtype)
        sin = angles.sin().repeat_interleave(2, dim=-1).to(tokens.dtype)
        return tokens * cos + rotate_every_two(tokens) * sin


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, proj_bias=True, qk_norm=False, fused_attn=True, rope=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.rope = rope

    def forward(self, x, pos=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.rope is not None:
            q = self.rope(q, pos)
            k = self.rope(k, pos)

        q = self.q_norm(q)
        k = self.k_norm(k)

        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1.0):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.dim
        rope = RotaryPositionEmbedding1D(freq=config.rope_freq) if config.use_rope else None
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(
            dim, config.num_heads, qk_norm=config.qk_norm, fused_attn=config.fused_attn, rope=rope
        )
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio))
        self.ls2 = LayerScale(dim)

    def forward(self, x, pos=None):
        x = x + self.ls1(self.attn(self.norm1(x), pos=pos))
        return x + self.ls2(self.mlp(self.norm2(x)))


class Pi3Decoder(nn.Module):
    """One global-attention block of the Pi3 decoder over a (scene, tokens, dim) sequence."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([Block(config)])
        self.norm = nn.LayerNorm(config.dim, eps=1e-6)

    def forward(self, hidden):
        pos = None
        if self.config.use_rope:
            pos = torch.arange(hidden.shape[1], device=hidden.device)
        for blk in self.blocks:
            hidden = blk(hidden, pos=pos)
        return self.norm(hidden)


def make_pi3_rope():
    torch.manual_seed(5308)
    model = Pi3Decoder(Pi3DecoderConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, LayerScale):
                mod.gamma.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_pi3_rope',
 'kind': 'multihead',
 'ok': False,
 'layer': 'blocks.0.attn',
 'stage': 'normed_queries',
 'mistake': 'qk_norm_misplaced',
 'style': 'Pi3 (yyfz) visual-geometry decoder attention (DINOv2/timm-style Attention): one bug: '
          'q_norm/k_norm moved below the rotary call: the per-head LayerNorm (non-uniform gain and '
          'bias) acts on rotated heads'}
