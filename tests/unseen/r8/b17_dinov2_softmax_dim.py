"""DINOv2 / timm-style ViT block written without timm, with the attention softmax
taken over dim=-2 (over queries) instead of over keys.
"""

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim=96, num_heads=6, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = (
            self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-2)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class Block(nn.Module):
    def __init__(self, dim=96, num_heads=6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.ls1 = LayerScale(dim, init_values=1.0)

    def forward(self, x):
        return x + self.ls1(self.attn(self.norm1(x)))


def make_dinov2_block():
    torch.manual_seed(19)
    blk = Block()
    with torch.no_grad():
        blk.norm1.weight.uniform_(0.5, 1.5)
        blk.ls1.gamma.uniform_(0.5, 1.5)
    return blk


EXPECT = {
    "target": "make_dinov2_block",
    "kind": "multihead",
    "ok": False,
    "layer": "attn",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "DINOv2 / timm ViT fused-qkv Attention: attn.softmax(dim=-2) normalises each key column over queries",
}
