"""Sana (NVlabs/Sana) LiteLA self-attention, the linear attention of Sana's blocks: fused qkv laid out
(3, B, C, N), ReLU feature map on q and k, values padded with a row of ones so (v @ k) @ q carries its
own normaliser, out[:-1] / (out[-1] + eps), proj. 4 heads of 16, non-causal; no softmax anywhere.

This file: refused (ReLU-kernel linear attention, no softmax over scores)."""

import torch
import torch.nn.functional as F
from torch import nn


class LiteLA(nn.Module):
    """Sana's lightweight linear attention: ReLU kernel, (v padded with ones) @ k then @ q."""

    def __init__(self, in_channels=64, heads_dim=16, eps=1e-15):
        super().__init__()
        self.dim = heads_dim
        self.heads = in_channels // heads_dim
        self.eps = eps
        self.qkv = nn.Linear(in_channels, in_channels * 3, bias=False)
        self.kernel_func = nn.ReLU(inplace=False)
        self.proj = nn.Linear(in_channels, in_channels)

    def attn_matmul(self, q, k, v):
        # q, v: (B, h, d, N); k: (B, h, N, d)
        q = self.kernel_func(q)
        k = self.kernel_func(k)
        v = F.pad(v, (0, 0, 0, 1), mode="constant", value=1.0)
        vk = torch.matmul(v, k)
        out = torch.matmul(vk, q)
        return out[:, :, :-1] / (out[:, :, -1:] + self.eps)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, C).permute(2, 0, 3, 1)  # (3, B, C, N)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q.reshape(B, C // self.dim, self.dim, N)
        k = k.reshape(B, C // self.dim, self.dim, N).transpose(-1, -2)
        v = v.reshape(B, C // self.dim, self.dim, N)
        out = self.attn_matmul(q, k, v)
        out = out.reshape(B, C, N).permute(0, 2, 1)
        return self.proj(out)


class SanaSelfBlock(nn.Module):
    def __init__(self, hidden_size=64):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = LiteLA(hidden_size, heads_dim=16)

    def forward(self, x):
        return x + self.attn(self.norm1(x))


def make_sana_linear_self():
    torch.manual_seed(2341)
    return SanaSelfBlock().eval()


EXPECT = {
    "target": "make_sana_linear_self",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "linear_attention",
    "style": "Sana LiteLA: ReLU-kernel linear attention, normalised by a ones-padded value row instead of a softmax",
}
