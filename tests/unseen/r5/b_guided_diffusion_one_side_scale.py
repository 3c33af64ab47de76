"""guided-diffusion QKVAttention (new order: q, k, v chunks) with Conv1d projections; bug: the ch**-0.25 factor is applied to q only."""

import math

import torch
import torch.nn as nn


class QKVAttention(nn.Module):
    """Attention over (N, 3 * H * C, T) split as q, k, v first, then heads."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv):
        bs, width, length = qkv.shape
        assert width % (3 * self.n_heads) == 0
        ch = width // (3 * self.n_heads)
        q, k, v = qkv.chunk(3, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum(
            "bct,bcs->bts",
            (q * scale).view(bs * self.n_heads, ch, length),
            k.reshape(bs * self.n_heads, ch, length),
        )
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        a = torch.einsum("bts,bcs->bct", weight, v.reshape(bs * self.n_heads, ch, length))
        return a.reshape(bs, -1, length)


class TokenAttentionBlock(nn.Module):
    def __init__(self, channels, num_heads=1):
        super().__init__()
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.attention = QKVAttention(num_heads)
        self.proj_out = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        h = self.attention(self.qkv(x.transpose(1, 2)))
        return self.proj_out(h).transpose(1, 2)


def make_attention_block():
    return TokenAttentionBlock(channels=20, num_heads=4)


EXPECT = {
    "target": "make_attention_block",
    "kind": "multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "guided-diffusion QKVAttention with Conv1d qkv/proj_out on (B, T, C) input (q * ch**-0.25 only)",
}
