"""MCG-NJU VideoMAE style Attention in a pre-LN Block with layer scale: qkv Linear without bias plus
separate q_bias and v_bias Parameters (keys get zeros) concatenated into the bias of F.linear,
reshape(B, N, 3, H, -1).permute(2, 0, 3, 1, 4), q * scale, q @ k.transpose(-2, -1), softmax,
(attn @ v).transpose(1, 2).reshape(B, N, -1), proj. The tokens are flattened tubelet patches;
dim 96, 6 heads of 16. Bidirectional.

This file's one bug: VideoMAE Attention: permute(2, 0, 1, 3, 4) leaves q/k/v as (B, N, H, d), so
'heads' are the tokens and each token attends across its own heads."""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        dim,
        num_heads=8,
        qkv_bias=False,
        qk_scale=None,
        attn_drop=0.0,
        proj_drop=0.0,
        attn_head_dim=None,
    ):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        if attn_head_dim is not None:
            head_dim = attn_head_dim
        all_head_dim = head_dim * self.num_heads
        self.scale = qk_scale or head_dim**-0.5
        self.qkv = nn.Linear(dim, all_head_dim * 3, bias=False)
        if qkv_bias:
            self.q_bias = nn.Parameter(torch.zeros(all_head_dim))
            self.v_bias = nn.Parameter(torch.zeros(all_head_dim))
        else:
            self.q_bias = None
            self.v_bias = None
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(all_head_dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = None
        if self.q_bias is not None:
            qkv_bias = torch.cat(
                (self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias)
            )
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 1, 3, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, -1)
        x = self.proj(x)
        return self.proj_drop(x)


class Block(nn.Module):
    def __init__(self, dim=96, num_heads=6, mlp_ratio=4.0, init_values=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim)
        )
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        x = x + self.gamma_1 * self.attn(self.norm1(x))
        return x + self.gamma_2 * self.mlp(self.norm2(x))


def make_videomae_block():
    torch.manual_seed(1211)
    block = Block()
    with torch.no_grad():
        for ln in (block.norm1, block.norm2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.2, 0.2)
        block.attn.q_bias.uniform_(-0.1, 0.1)
        block.attn.v_bias.uniform_(-0.1, 0.1)
        block.gamma_1.uniform_(0.05, 0.2)
        block.gamma_2.uniform_(0.05, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_videomae_block",
    "kind": "multihead",
    "ok": False,
    "layer": "attn",
    "stage": "queries",
    "mistake": "heads_split",
    "style": "VideoMAE Attention: permute(2, 0, 1, 3, 4) leaves q/k/v as (B, N, H, d), so 'heads' are "
    "the tokens and each token attends across its own heads",
}
