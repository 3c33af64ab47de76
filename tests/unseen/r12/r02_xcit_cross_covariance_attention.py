"""XCiT (facebookresearch/xcit) style XCA, cross-covariance attention, in a pre-LN block: fused qkv
reshaped (B, N, 3, H, C // H).permute(2, 0, 3, 1, 4), then q, k, v transposed to (B, H, d, N),
q and k L2-normalised along the tokens, attention (q @ k^T) * temperature is a (d x d) map over
feature channels with a learned per-head temperature, softmax, (attn @ v).permute(0, 3, 1, 2),
proj. Outside the vocabulary: the softmax runs over channels, not over keys."""

import torch
import torch.nn.functional as F
from torch import nn


class XCA(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q.transpose(-2, -1)
        k = k.transpose(-2, -1)
        v = v.transpose(-2, -1)
        q = F.normalize(q, dim=-1)
        k = F.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)) * self.temperature
        attn = attn.softmax(dim=-1)
        x = (attn @ v).permute(0, 3, 1, 2).reshape(B, N, C)
        return self.proj(x)


class XCABlock(nn.Module):
    def __init__(self, dim=64, num_heads=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = XCA(dim, num_heads=num_heads, qkv_bias=True)
        self.gamma1 = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        return x + self.gamma1 * self.attn(self.norm1(x))


def make_xcit_block():
    torch.manual_seed(1292)
    block = XCABlock()
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 1.5)
        block.norm1.bias.uniform_(-0.2, 0.2)
        block.attn.temperature.uniform_(0.5, 2.0)
    return block.eval()


EXPECT = {
    "target": "make_xcit_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "cross_covariance",
    "style": "XCiT XCA: attention over feature channels of L2-normalised q and k with a learned "
    "per-head temperature",
}
