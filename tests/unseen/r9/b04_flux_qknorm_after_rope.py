"""Flux image-stream attention with the rotary hoisted out of attention() and put
before the QKNorm.

attention() no longer applies the rope; SelfAttention.forward applies apply_rope right
after the rearrange and then QKNorm (per-head RMSNorm with a learned, non-uniform scale),
so the norm runs after the rotation instead of before it.
"""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    assert dim % 2 == 0
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos.to(torch.float64), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    out = rearrange(out, "b n d (i j) -> b n d i j", i=2, j=2)
    return out


def apply_rope(xq: Tensor, xk: Tensor, freqs_cis: Tensor):
    xq_ = xq.reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor) -> Tensor:
    x = F.scaled_dot_product_attention(q, k, v)
    x = rearrange(x, "B H L D -> B L (H D)")
    return x


class EmbedND(nn.Module):
    def __init__(self, dim: int, theta: int, axes_dim: list):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.axes_dim = axes_dim

    def forward(self, ids: Tensor) -> Tensor:
        n_axes = ids.shape[-1]
        emb = torch.cat(
            [rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3
        )
        return emb.unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor):
        x_dtype = x.dtype
        rrms = torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + 1e-6)
        return (x * rrms).to(dtype=x_dtype) * self.scale


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor):
        q = self.query_norm(q)
        k = self.key_norm(k)
        return q.to(v), k.to(v)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, pe: Tensor) -> Tensor:
        qkv = self.qkv(x)
        q, k, v = rearrange(qkv, "B L (K H D) -> K B H L D", K=3, H=self.num_heads)
        q, k = apply_rope(q, k, pe)
        q, k = self.norm(q, k, v)
        x = attention(q, k, v, pe=pe)
        x = self.proj(x)
        return x


class ImageStreamBlock(nn.Module):
    """The image half of a Flux DoubleStreamBlock, run on its own."""

    def __init__(self, hidden_size=64, num_heads=4, theta=10000):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.pe_embedder = EmbedND(dim=self.head_dim, theta=theta, axes_dim=[self.head_dim])
        self.vec = nn.Parameter(torch.randn(hidden_size) * 0.5)
        self.img_mod = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(dim=hidden_size, num_heads=num_heads, qkv_bias=True)

    def forward(self, img: Tensor) -> Tensor:
        b, n, _ = img.shape
        ids = torch.arange(n, device=img.device)[None, :, None].expand(b, n, 1)
        pe = self.pe_embedder(ids)
        shift, scale, gate = self.img_mod(F.silu(self.vec))[None, None, :].chunk(3, dim=-1)
        img_modulated = (1 + scale) * self.img_norm1(img) + shift
        return img + gate * self.img_attn(img_modulated, pe=pe)


def make_flux_block():
    torch.manual_seed(105)
    blk = ImageStreamBlock()
    with torch.no_grad():
        blk.img_attn.norm.query_norm.scale.uniform_(0.5, 1.5)
        blk.img_attn.norm.key_norm.scale.uniform_(0.5, 1.5)
    return blk.eval()


EXPECT = {
    "target": "make_flux_block",
    "kind": "multihead",
    "ok": False,
    "layer": "img_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "Flux SelfAttention (fused qkv, EmbedND pe, per-head QKNorm with learned scale): apply_rope moved out of attention() and placed before self.norm, so the norm follows the rotation",
}
