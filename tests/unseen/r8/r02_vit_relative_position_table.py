"""ViT encoder attention with a learned relative position bias table (BEiT / Swin
style, 1-D over the token sequence): relative_position_bias_table of shape
(2 * max_len - 1, heads) indexed by i - j + max_len - 1 and added to the scaled
scores.  The learned bias is outside what this round expects the checker to model:
should be refused.
"""

import torch
from torch import nn


class RelPosAttention(nn.Module):
    def __init__(self, dim=64, num_heads=4, max_len=64):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.max_len = max_len
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(2 * max_len - 1, num_heads))
        coords = torch.arange(max_len)
        rel = coords[:, None] - coords[None, :] + max_len - 1
        self.register_buffer("relative_position_index", rel, persistent=False)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index[:N, :N].reshape(-1)]
        bias = bias.view(N, N, -1).permute(2, 0, 1)
        attn = (attn + bias.unsqueeze(0)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(64)
        self.attn = RelPosAttention()

    def forward(self, x):
        return x + self.attn(self.norm1(x))


def make_relpos_block():
    torch.manual_seed(202)
    blk = Block()
    with torch.no_grad():
        blk.norm1.weight.uniform_(0.5, 1.5)
        blk.attn.relative_position_bias_table.normal_(0.0, 0.5)
    return blk


EXPECT = {
    "target": "make_relpos_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "relative_bias",
    "style": "BEiT/Swin-style learned relative_position_bias_table (1-D, 127 x heads) on a ViT encoder: a learned "
    "relative bias, which this round expects to be refused",
}
