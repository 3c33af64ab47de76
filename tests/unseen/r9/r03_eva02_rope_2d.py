"""EVA-02 (baaivision/EVA, eva02 modeling) ViT attention with 2D vision rotary.

qkv Linear without bias plus separate q_bias / v_bias parameters (keys unbiased), as in
EVA/BEiT. VisionRotaryEmbeddingFast: half of each head's features rotate with the patch
row, the other half with the patch column (per-axis frequencies repeated '(n r)' for
adjacent pairs, rotate_half on pairs). Token 0 is the [CLS] token and is not rotated.
Patches are laid out on a grid 4 wide, so any token count works. A two-axis position
rotation is outside the vocabulary: this round expects a refusal.
"""

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn


def rotate_half(x):
    x = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return rearrange(x, "... d r -> ... (d r)")


class VisionRotaryEmbeddingFast(nn.Module):
    def __init__(self, dim, grid_rows=16, grid_cols=4, theta=10000):
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        t_r = torch.arange(grid_rows).float()
        t_c = torch.arange(grid_cols).float()
        f_r = repeat(torch.einsum("..., f -> ... f", t_r, freqs), "... n -> ... (n r)", r=2)
        f_c = repeat(torch.einsum("..., f -> ... f", t_c, freqs), "... n -> ... (n r)", r=2)
        freqs = torch.cat(
            (
                f_r[:, None, :].expand(grid_rows, grid_cols, -1),
                f_c[None, :, :].expand(grid_rows, grid_cols, -1),
            ),
            dim=-1,
        )
        freqs = freqs.reshape(grid_rows * grid_cols, -1)
        self.register_buffer("freqs_cos", freqs.cos())
        self.register_buffer("freqs_sin", freqs.sin())

    def forward(self, t):
        n = t.shape[-2]
        return t * self.freqs_cos[:n] + rotate_half(t) * self.freqs_sin[:n]


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, rope=None):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        if qkv_bias:
            self.q_bias = nn.Parameter(torch.zeros(dim))
            self.v_bias = nn.Parameter(torch.zeros(dim))
        else:
            self.q_bias = None
            self.v_bias = None
        self.rope = rope
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = None
        if self.q_bias is not None:
            qkv_bias = torch.cat(
                (self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias)
            )
        qkv = F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.rope is not None:
            q_t = q[:, :, 1:, :]
            ro_q_t = self.rope(q_t)
            q = torch.cat((q[:, :, :1, :], ro_q_t), -2).type_as(v)
            k_t = k[:, :, 1:, :]
            ro_k_t = self.rope(k_t)
            k = torch.cat((k[:, :, :1, :], ro_k_t), -2).type_as(v)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, -1)
        return self.proj(x)


class EvaBlock(nn.Module):
    def __init__(self, dim=64, num_heads=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        rope = VisionRotaryEmbeddingFast(dim // num_heads // 2)
        self.attn = Attention(dim, num_heads, qkv_bias=True, rope=rope)

    def forward(self, x):
        return x + self.attn(self.norm1(x))


def make_eva_block():
    torch.manual_seed(203)
    blk = EvaBlock()
    with torch.no_grad():
        blk.norm1.weight.uniform_(0.5, 1.5)
        blk.norm1.bias.uniform_(-0.1, 0.1)
        blk.attn.q_bias.uniform_(-0.2, 0.2)
        blk.attn.v_bias.uniform_(-0.2, 0.2)
        blk.attn.qkv.weight.mul_(3.0)
    return blk.eval()


EXPECT = {
    "target": "make_eva_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "rope_2d",
    "style": "EVA-02 ViT Attention (qkv without bias + q_bias/v_bias, VisionRotaryEmbeddingFast: row frequencies on "
    "half the head, column frequencies on the other half, '(n r)' adjacent pairs, [CLS] token unrotated)",
}
