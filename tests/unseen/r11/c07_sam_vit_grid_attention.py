"""Segment Anything image-encoder ViT Attention (use_rel_pos=False) on a (B, H, W, C) grid: fused
qkv reshaped to (B, H*W, 3, heads, -1), permuted and folded to (3, B*heads, H*W, head_dim),
attn = (q * scale) @ k^T, softmax, (attn @ v) unfolded back to (B, H, W, C) and proj. The wrapper
lays a token sequence out as an H = tokens, W = 1 grid, as the windowed blocks do."""

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, use_rel_pos=False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.use_rel_pos = use_rel_pos

    def forward(self, x):
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        x = self.proj(x)
        return x


class Block(nn.Module):
    def __init__(self, dim=64, num_heads=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads)

    def forward(self, tokens):
        B, N, C = tokens.shape
        x = self.norm1(tokens).view(B, N, 1, C)
        x = self.attn(x)
        return tokens + x.view(B, N, C)


def make_sam_vit_block():
    torch.manual_seed(1107)
    block = Block()
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 1.5)
        block.norm1.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_sam_vit_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Segment Anything image-encoder ViT Attention (use_rel_pos=False) on a (B, tokens, 1, C) "
    "grid: fused qkv reshaped (B, HW, 3, heads, -1).permute(2, 0, 3, 1, 4) and folded to (3, "
    "B*heads, HW, d), (q * scale) @ k^T, unfolded via view(B, heads, H, W, -1).permute(0, 2, "
    "3, 1, 4); pre-LN block",
}
