"""guided-diffusion QKVAttentionLegacy: channels-first Conv1d qkv with per-head [q, k, v] blocks, both sides scaled by ch**-0.25."""

import math

import torch
import torch.nn as nn


class QKVAttentionLegacy(nn.Module):
    """Attention over a (N, H * 3 * C, T) tensor laid out per head as [q, k, v]."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv):
        bs, width, length = qkv.shape
        assert width % (3 * self.n_heads) == 0
        ch = width // (3 * self.n_heads)
        q, k, v = qkv.reshape(bs * self.n_heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum(
            "bct,bcs->bts", q * scale, k * scale
        )  # more stable than dividing afterwards
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        a = torch.einsum("bts,bcs->bct", weight, v)
        return a.reshape(bs, -1, length)


class TokenAttentionBlock(nn.Module):
    """The AttentionBlock's projections around QKVAttentionLegacy, for (batch, tokens, channels) input.

    The original block also normalizes and adds a residual; both are left to the caller here.
    """

    def __init__(self, channels, num_heads=1):
        super().__init__()
        self.channels = channels
        self.num_heads = num_heads
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.attention = QKVAttentionLegacy(self.num_heads)
        self.proj_out = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        h = x.transpose(1, 2)  # (B, C, T)
        h = self.attention(self.qkv(h))
        return self.proj_out(h).transpose(1, 2)


def make_attention_block():
    return TokenAttentionBlock(channels=12, num_heads=3)


EXPECT = {
    "target": "make_attention_block",
    "kind": "multihead",
    "ok": True,
    "style": "guided-diffusion AttentionBlock/QKVAttentionLegacy (Conv1d qkv, channels-first, per-head [q,k,v], q and k each * ch**-0.25)",
}
