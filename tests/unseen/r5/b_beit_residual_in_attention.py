"""BEiT-style Attention (q_bias/v_bias, zero key bias, no relative bias) in a Block with layer scale; bug: the attention adds its input back (a residual inside attention)."""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(
        self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0, window_size=None
    ):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        all_head_dim = head_dim * self.num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, all_head_dim * 3, bias=False)
        if qkv_bias:
            self.q_bias = nn.Parameter(torch.empty(all_head_dim).uniform_(-0.1, 0.1))
            self.v_bias = nn.Parameter(torch.empty(all_head_dim).uniform_(-0.1, 0.1))
        else:
            self.q_bias = None
            self.v_bias = None
        if window_size is not None:
            raise NotImplementedError("relative position bias not used in this variant")
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(all_head_dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = None
        if self.q_bias is not None:
            qkv_bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]

        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = self.attn_drop(attn.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(B, N, -1)
        out = self.proj_drop(self.proj(out))
        return x + out


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=2.0, qkv_bias=True, init_values=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        x = x + self.gamma_1 * self.attn(self.norm1(x))
        return x + self.gamma_2 * self.mlp(self.norm2(x))


def make_block():
    return Block(dim=20, num_heads=4, qkv_bias=True)


EXPECT = {
    "target": "make_block",
    "kind": "multihead",
    "ok": False,
    "stage": "output",
    "mistake": "other",
    "layer": "attn",
    "style": "BEiT Block/Attention without relative bias (q_bias/v_bias; residual added inside the attention)",
}
