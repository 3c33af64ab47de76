"""CroCo / DUSt3R decoder (naver/croco models/blocks.py, reused by naver/dust3r): a DecoderBlock
with bidirectional self-attention (one fused qkv Linear reshaped to (B, N, 3, heads, d) and
transposed),
then cross-attention from the decoder tokens to the other view's memory (separate projq / projk /
projv Linears, heads split by reshape + permute, scale head_dim ** -0.5, proj), then the MLP, all
pre-norm with norm_y on the memory. Position encoding is the "cosine" variant: absolute embeddings
added before the decoder, so rope is None inside the attention.

This file: refused (pos_embed='RoPE100': RoPE2D inside the attention, query and memory tokens
rotated by their (row, column) on a grid 8 wide; 8 heads of 8)."""

import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim, rope=None, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.rope = rope

    def forward(self, x, xpos):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).transpose(1, 3)
        q, k, v = [qkv[:, :, i] for i in range(3)]
        if self.rope is not None:
            q = self.rope(q, xpos)
            k = self.rope(k, xpos)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class CrossAttention(nn.Module):
    def __init__(self, dim, rope=None, num_heads=8, qkv_bias=False, use_sdpa=False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.projq = nn.Linear(dim, dim, bias=qkv_bias)
        self.projk = nn.Linear(dim, dim, bias=qkv_bias)
        self.projv = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.rope = rope
        self.use_sdpa = use_sdpa

    def forward(self, query, key, value, qpos, kpos):
        B, Nq, C = query.shape
        Nk = key.shape[1]
        Nv = value.shape[1]

        q = (
            self.projq(query)
            .reshape(B, Nq, self.num_heads, C // self.num_heads)
            .permute(0, 2, 1, 3)
        )
        k = self.projk(key).reshape(B, Nk, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        v = (
            self.projv(value)
            .reshape(B, Nv, self.num_heads, C // self.num_heads)
            .permute(0, 2, 1, 3)
        )

        if self.rope is not None:
            q = self.rope(q, qpos)
            k = self.rope(k, kpos)

        if self.use_sdpa:
            x = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        else:
            attn = (q @ k.transpose(-2, -1)) * self.scale
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, Nq, C)
        x = self.proj(x)
        return x


class DecoderBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, rope=None, use_sdpa=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, rope=rope, num_heads=num_heads, qkv_bias=qkv_bias)
        self.cross_attn = CrossAttention(
            dim, rope=rope, num_heads=num_heads, qkv_bias=qkv_bias, use_sdpa=use_sdpa
        )
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.norm_y = nn.LayerNorm(dim)

    def forward(self, x, y, xpos, ypos):
        x = x + self.attn(self.norm1(x), xpos)
        y_ = self.norm_y(y)
        x = x + self.cross_attn(self.norm2(x), y_, y_, xpos, ypos)
        x = x + self.mlp(self.norm3(x))
        return x, y


def grid_positions(batch, n, width, device):
    idx = torch.arange(n, device=device)
    pos = torch.stack((idx // width, idx % width), dim=-1)
    return pos[None].expand(batch, n, 2)


class RoPE2D(nn.Module):
    """2D rotary embedding: first half of each head rotated by the row, second by the column."""

    def __init__(self, freq=100.0):
        super().__init__()
        self.base = freq

    def get_cos_sin(self, D, pos, dtype):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        freqs = pos.to(torch.float64)[..., None] * inv_freq
        freqs = torch.cat((freqs, freqs), dim=-1)
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        return cos[:, None], sin[:, None]

    @staticmethod
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def apply_rope1d(self, tokens, pos):
        cos, sin = self.get_cos_sin(tokens.size(3), pos, tokens.dtype)
        return tokens * cos + self.rotate_half(tokens) * sin

    def forward(self, tokens, positions):
        y, x = tokens.chunk(2, dim=-1)
        y = self.apply_rope1d(y, positions[:, :, 0])
        x = self.apply_rope1d(x, positions[:, :, 1])
        return torch.cat((y, x), dim=-1)


class CroCoDecoder(nn.Module):
    def __init__(self, dim=64, depth=1, num_heads=8, qkv_bias=True, use_sdpa=False):
        super().__init__()
        self.grid_width = 8
        rope = RoPE2D(freq=100.0)
        self.dec_blocks = nn.ModuleList(
            [
                DecoderBlock(dim, num_heads, qkv_bias=qkv_bias, rope=rope, use_sdpa=use_sdpa)
                for _ in range(depth)
            ]
        )
        self.dec_norm = nn.LayerNorm(dim)

    def forward(self, hidden, context):
        B, N, _ = hidden.shape
        xpos = grid_positions(B, N, self.grid_width, hidden.device)
        ypos = grid_positions(B, context.shape[1], self.grid_width, hidden.device)
        x, y = hidden, context
        for blk in self.dec_blocks:
            x, y = blk(x, y, xpos, ypos)
        return self.dec_norm(x)


def make_croco_decoder():
    torch.manual_seed(3808)
    model = CroCoDecoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_croco_decoder",
    "kind": "cross",
    "ok": True,
    "layer": "dec_blocks.0.cross_attn",
    "unsupported": "rope_2d",
    "style": (
        "CroCo/DUSt3R DecoderBlock cross_attn: refused (pos_embed='RoPE100': RoPE2D "
        "inside the attention, query and memory tokens rotated by their (row, column) on "
        "a grid 8 wide; 8 heads of 8)"
    ),
}
