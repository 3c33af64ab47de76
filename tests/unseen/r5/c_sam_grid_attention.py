"""Segment-Anything image-encoder Attention (use_rel_pos=False, heads folded into batch) run on a 1 x T token grid."""

import torch
import torch.nn as nn


class Attention(nn.Module):
    """Multi-head attention block with optional relative position embeddings (disabled here)."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        use_rel_pos: bool = False,
        input_size: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

        self.use_rel_pos = use_rel_pos
        if self.use_rel_pos:
            raise NotImplementedError("relative positions are not part of this port")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, _ = x.shape
        # qkv with shape (3, B, nHead, H * W, C)
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        # q, k, v with shape (B * nHead, H * W, C)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)

        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


class MLPBlock(nn.Module):
    def __init__(self, embedding_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(embedding_dim, mlp_dim)
        self.lin2 = nn.Linear(mlp_dim, embedding_dim)
        self.act = nn.GELU()

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


class Block(nn.Module):
    """Transformer block with global attention (window_size=0)."""

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, use_rel_pos=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(embedding_dim=dim, mlp_dim=int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.attn(self.norm1(x))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class TokenGrid(nn.Module):
    """Lays a (batch, tokens, dim) sequence out as a 1 x tokens image for the SAM block."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        return self.block(x.view(B, 1, T, C)).view(B, T, C)


def make_encoder_block():
    return TokenGrid(Block(dim=20, num_heads=4, mlp_ratio=2.0))


EXPECT = {
    "target": "make_encoder_block",
    "kind": "multihead",
    "ok": True,
    "layer": "block.attn",
    "style": "SAM ImageEncoderViT Attention (B, H, W, C input, heads folded into batch, no rel pos) behind a grid adapter",
}
