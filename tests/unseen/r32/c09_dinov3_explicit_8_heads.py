"""DINOv3 (facebookresearch/dinov3, dinov3/layers/attention.py, block.py, rope_position_encoding.py):
`SelfAttention(dim, num_heads, qkv_bias, proj_bias, attn_drop, proj_drop, mask_k_bias)` with one fused
`qkv` (LinearKMaskedBias when mask_k_bias: the key third of the bias multiplied by a zero mask),
reshape to (B, N, 3, heads, head_dim), `torch.unbind(qkv, 2)`, optional `rope` = (sin, cos) applied
with rope_rotate_half to the patch tokens after the prefix (cls + storage) tokens, SDPA (or the
explicit q * scale @ k^T fallback), `proj`; `SelfAttentionBlock` (norm1/attn/ls1/norm2/mlp/ls2) whose
list path flattens the batch with cat_keep_shapes for the linear layers. Bidirectional (one image's
tokens).

This file: correct (8 heads of 8, explicit q * scale @ k^T softmax path, bidirectional, no RoPE)"""

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

USE_SDPA = False


def cat_keep_shapes(x_list: List[Tensor]) -> Tuple[Tensor, List[torch.Size], List[int]]:
    shapes = [x.shape for x in x_list]
    num_tokens = [x.select(dim=-1, index=0).numel() for x in x_list]
    flattened = torch.cat([x.flatten(0, -2) for x in x_list])
    return flattened, shapes, num_tokens


def uncat_with_shapes(flattened: Tensor, shapes, num_tokens) -> List[Tensor]:
    outputs_splitted = torch.split_with_sizes(flattened, num_tokens, dim=0)
    shapes_adjusted = [shape[:-1] + torch.Size([flattened.shape[-1]]) for shape in shapes]
    return [o.reshape(shape) for o, shape in zip(outputs_splitted, shapes_adjusted)]


def rope_rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_apply(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    return (x * cos) + (rope_rotate_half(x) * sin)


class LinearKMaskedBias(nn.Linear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        o = self.out_features
        assert o % 3 == 0
        if self.bias is not None:
            bias_mask = torch.ones_like(self.bias)
            bias_mask[o // 3 : 2 * o // 3] = 0.0
            self.register_buffer("bias_mask", bias_mask)

    def forward(self, input: Tensor) -> Tensor:
        masked_bias = self.bias * self.bias_mask.to(self.bias.dtype) if self.bias is not None else None
        return F.linear(input, self.weight, masked_bias)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, proj_bias=True, attn_drop=0.0, proj_drop=0.0,
                 mask_k_bias=False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        linear_class = LinearKMaskedBias if mask_k_bias else nn.Linear
        self.qkv = linear_class(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def apply_rope(self, q: Tensor, k: Tensor, rope) -> Tuple[Tensor, Tensor]:
        # rope = (sin, cos) for the patch tokens; prefix tokens (cls, storage) are left as they are
        q_dtype, k_dtype = q.dtype, k.dtype
        sin, cos = rope
        N = q.shape[-2]
        prefix = N - sin.shape[-2]
        assert prefix >= 0
        q = torch.cat((q[:, :, :prefix, :], rope_apply(q[:, :, prefix:, :], sin, cos)), dim=-2)
        k = torch.cat((k[:, :, :prefix, :], rope_apply(k[:, :, prefix:, :], sin, cos)), dim=-2)
        return q.to(q_dtype), k.to(k_dtype)

    def forward(self, x: Tensor, attn_bias=None, rope=None) -> Tensor:
        return self.forward_list([x], attn_bias=attn_bias, rope_list=[rope])[0]

    def forward_list(self, x_list, attn_bias=None, rope_list=None) -> List[Tensor]:
        assert len(x_list) == len(rope_list)
        x_flat, shapes, num_tokens = cat_keep_shapes(x_list)
        qkv_flat = self.qkv(x_flat)
        qkv_list = uncat_with_shapes(qkv_flat, shapes, num_tokens)
        att_out = []
        for qkv, rope in zip(qkv_list, rope_list):
            att_out.append(self.compute_attention(qkv, attn_bias=attn_bias, rope=rope))
        x_flat, shapes, num_tokens = cat_keep_shapes(att_out)
        x_flat = self.proj(x_flat)
        return uncat_with_shapes(x_flat, shapes, num_tokens)

    def compute_attention(self, qkv: Tensor, attn_bias=None, rope=None) -> Tensor:
        assert attn_bias is None
        B, N, _ = qkv.shape
        C = self.qkv.in_features

        qkv = qkv.reshape(B, N, 3, self.num_heads, C // self.num_heads)
        q, k, v = torch.unbind(qkv, 2)
        q, k, v = [t.transpose(1, 2) for t in [q, k, v]]
        if rope is not None:
            q, k = self.apply_rope(q, k, rope)
        if USE_SDPA:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2)
        return x.reshape([B, N, C])


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SelfAttentionBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=2.0, qkv_bias=True, mask_k_bias=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = SelfAttention(dim, num_heads=num_heads, qkv_bias=qkv_bias, mask_k_bias=mask_k_bias)
        self.ls1 = LayerScale(dim, init_values=1.0)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim, init_values=1.0)

    def forward(self, x, rope=None):
        x = x + self.ls1(self.attn(self.norm1(x), rope=rope))
        x = x + self.ls2(self.mlp(self.norm2(x)))
        return x


class RopePositionEmbedding(nn.Module):
    """Axial 2D RoPE over a patch grid of width `grid_w` (periods in base ** (4i / head_dim))."""

    def __init__(self, embed_dim, num_heads, base=100.0, grid_w=4):
        super().__init__()
        D_head = embed_dim // num_heads
        self.D_head = D_head
        self.grid_w = grid_w
        periods = base ** (2 * torch.arange(D_head // 4, dtype=torch.float64) / (D_head // 2))
        self.register_buffer("periods", periods, persistent=False)

    def forward(self, n_patches, dtype):
        idx = torch.arange(n_patches, dtype=torch.float64)
        coords = torch.stack([idx // self.grid_w, idx % self.grid_w], dim=-1)  # (row, col)
        coords = 2.0 * (coords + 0.5) / self.grid_w - 1.0
        angles = 2 * math.pi * coords[:, :, None] / self.periods[None, None, :]
        angles = angles.flatten(1, 2).tile(2)  # [HW, D_head]
        return torch.sin(angles).to(dtype), torch.cos(angles).to(dtype)


class DinoVisionTransformer(nn.Module):
    """Token-level trunk: takes already-embedded tokens (B, N, 64)."""

    def __init__(self, embed_dim=64, num_heads=4, n_storage_tokens=0, use_rope=False):
        super().__init__()
        self.n_storage_tokens = n_storage_tokens
        self.blocks = nn.ModuleList([SelfAttentionBlock(embed_dim, num_heads)])
        self.rope_embed = RopePositionEmbedding(embed_dim, num_heads) if use_rope else None
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x):
        rope = None
        if self.rope_embed is not None:
            n_patches = max(x.shape[1] - 1 - self.n_storage_tokens, 0)
            rope = self.rope_embed(n_patches, x.dtype)
        for blk in self.blocks:
            x = blk(x, rope=rope)
        return self.norm(x)


def make_dinov3_vit():
    torch.manual_seed(3209)
    model = DinoVisionTransformer(embed_dim=64, num_heads=8)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, LayerScale):
                mod.gamma.uniform_(0.5, 1.0)
            if isinstance(mod, LinearKMaskedBias):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_dinov3_vit',
 'kind': 'multihead',
 'ok': True,
 'layer': 'blocks.0.attn',
 'structure': {'heads': 8,
               'kv_heads': 8,
               'head_dim': 8,
               'causal': False,
               'cross': False,
               'rope': None,
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'DINOv3 SelfAttention (facebookresearch/dinov3 dinov3/layers/attention.py): correct (8 '
          'heads of 8, explicit q * scale @ k^T softmax path, bidirectional, no RoPE)'}
