"""Tortoise TTS (neonbjb/tortoise-tts `tortoise/models/arch_util.py`: AttentionBlock,
QKVAttentionLegacy, RelativePositionBias from `xtransformers.py`) in the conditioning-encoder
manner: channel-first (batch, channels, time) activations, a 1x1 Conv1d `qkv` whose output is
cut per head as [q | k | v] (reshape(bs * heads, 3 * ch, T).split(ch)), the 1/sqrt(ch) scale
split as 1/ch**0.25 on both q and k, einsum scores, optional T5-bucket learned relative position
bias (bidirectional, times sqrt(ch)) added to the scaled scores, softmax upcast, 1x1 Conv1d
`proj_out`. The GroupNorm and residual live in the surrounding AttentionBlock; the attention
itself is `blocks.N.attn`.

This file: correct (4 heads of 16, channel-first Conv1d qkv cut per head as [q|k|v], 1/ch**0.25
on q and k, T5-bucket learned relative bias x sqrt(16))"""

import math

import torch
from torch import nn


class TortoiseConfig:
    channels = 64
    num_heads = 4
    num_blocks = 1
    relative_pos_embeddings = True


class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.to(torch.promote_types(x.dtype, torch.float32))).type(x.dtype)


def normalization(channels):
    groups = 32 if channels > 64 else 16
    while channels % groups != 0:
        groups = int(groups / 2)
    return GroupNorm32(groups, channels)


class RelativePositionBias(nn.Module):
    def __init__(self, scale, causal=False, num_buckets=32, max_distance=128, heads=8):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = (
            max_exact
            + (
                torch.log(n.to(torch.float64).clamp(min=1) / max_exact)
                / math.log(max_distance / max_exact)
                * (num_buckets - max_exact)
            ).long()
        )
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        return ret + torch.where(is_small, n, val_if_large)

    def forward(self, qk_dots):
        i, j, device = qk_dots.shape[-2], qk_dots.shape[-1], qk_dots.device
        q_pos = torch.arange(i, dtype=torch.long, device=device)
        k_pos = torch.arange(j, dtype=torch.long, device=device)
        rel_pos = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(
            rel_pos,
            causal=self.causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        values = self.relative_attention_bias(rp_bucket).to(qk_dots.dtype)
        bias = values.permute(2, 0, 1)[None]
        return qk_dots + (bias * self.scale)


class QKVAttentionLegacy(nn.Module):
    """qkv: (bs, heads * 3 * ch, length), each head's block laid out as [q | k | v]."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv, rel_pos=None):
        bs, width, length = qkv.shape
        assert width % (3 * self.n_heads) == 0
        ch = width // (3 * self.n_heads)
        q, k, v = qkv.reshape(bs * self.n_heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)
        if rel_pos is not None:
            weight = rel_pos(
                weight.reshape(bs, self.n_heads, weight.shape[-2], weight.shape[-1])
            ).reshape(bs * self.n_heads, weight.shape[-2], weight.shape[-1])
        weight = torch.softmax(
            weight.to(torch.promote_types(weight.dtype, torch.float32)), dim=-1
        ).type(weight.dtype)
        a = torch.einsum("bts,bcs->bct", weight, v)
        return a.reshape(bs, -1, length)


class TortoiseSelfAttention(nn.Module):
    def __init__(self, channels, num_heads, relative_pos_embeddings=False):
        super().__init__()
        self.channels = channels
        self.num_heads = num_heads
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.attention = QKVAttentionLegacy(num_heads)
        self.proj_out = nn.Conv1d(channels, channels, 1)
        if relative_pos_embeddings:
            self.relative_pos_embeddings = RelativePositionBias(
                scale=(channels // num_heads) ** 0.5,
                causal=False,
                heads=num_heads,
                num_buckets=32,
                max_distance=64,
            )
        else:
            self.relative_pos_embeddings = None

    def forward(self, x):
        qkv = self.qkv(x)
        h = self.attention(qkv, self.relative_pos_embeddings)
        return self.proj_out(h)


class AttentionBlock(nn.Module):
    def __init__(self, channels, num_heads, relative_pos_embeddings=False):
        super().__init__()
        self.norm = normalization(channels)
        self.attn = TortoiseSelfAttention(channels, num_heads, relative_pos_embeddings)

    def forward(self, x):
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        h = self.attn(self.norm(x))
        return (x + h).reshape(b, c, *spatial)


class ConditioningEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.init = nn.Conv1d(config.channels, config.channels, kernel_size=1)
        self.blocks = nn.ModuleList(
            [
                AttentionBlock(config.channels, config.num_heads, config.relative_pos_embeddings)
                for _ in range(config.num_blocks)
            ]
        )

    def forward(self, x):
        h = self.init(x.transpose(1, 2))
        for block in self.blocks:
            h = block(h)
        return h.transpose(1, 2)


def make_tortoise_encoder():
    torch.manual_seed(3749)
    model = ConditioningEncoder(TortoiseConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.GroupNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Conv1d):
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Embedding):
                mod.weight.normal_(0.0, 0.3)
    return model.eval()


EXPECT = {
    "target": "make_tortoise_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "learned",
    },
    "style": "Tortoise TTS AttentionBlock / QKVAttentionLegacy: correct (4 heads of 16, "
    "channel-first Conv1d qkv cut per head as [q|k|v], 1/ch**0.25 on q and k, "
    "T5-bucket learned relative bias x sqrt(16))",
}
