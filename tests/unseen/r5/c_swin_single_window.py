"""Swin-style WindowAttention without the relative position bias, applied to one window that holds every token."""

import torch.nn as nn


class WindowAttention(nn.Module):
    r"""Window based multi-head self attention; this variant has no relative position bias.

    Args:
        dim: number of input channels.
        window_size: (Wh, Ww) of the window; one window of 1 x 64 covers a sequence of up to 64 tokens.
        num_heads: number of attention heads.
    """

    def __init__(
        self,
        dim,
        window_size,
        num_heads,
        qkv_bias=True,
        qk_scale=None,
        attn_drop=0.0,
        proj_drop=0.0,
    ):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim**-0.5

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, mask=None):
        """x: (num_windows*B, N, C); mask: (num_windows, N, N) of 0/-inf or None"""
        B_, N, C = x.shape
        assert self.window_size[0] * self.window_size[1] >= N, "window too small for the sequence"
        qkv = (
            self.qkv(x)
            .reshape(B_, N, 3, self.num_heads, C // self.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv[0], qkv[1], qkv[2]

        q = q * self.scale
        attn = q @ k.transpose(-2, -1)

        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


def make_window_attention():
    return WindowAttention(dim=12, window_size=(1, 64), num_heads=2)


EXPECT = {
    "target": "make_window_attention",
    "kind": "multihead",
    "ok": True,
    "style": "Swin WindowAttention (combined qkv, q * scale, nn.Softmax module) with no relative bias and one window",
}
