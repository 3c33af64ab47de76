"""timm-style attention that sets up self.proj but returns the merged heads directly."""

import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=False, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return x


EXPECT = {
    "target": "Attention",
    "kind": "multihead",
    "ok": False,
    "stage": "output",
    "mistake": "missing_out_proj",
}
