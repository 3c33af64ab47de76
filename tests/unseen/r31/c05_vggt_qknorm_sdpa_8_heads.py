"""VGGT (facebookresearch/vggt, vggt/layers/attention.py + block.py): DINOv2-derived Attention with a
fused qkv Linear reshaped (B, N, 3, heads, head_dim).permute(2, 0, 3, 1, 4), per-head q_norm/k_norm
LayerNorm (qk_norm=True), F.scaled_dot_product_attention or the explicit q*scale @ k^T path, proj;
Block with norm1/ls1/norm2/mlp/ls2 (LayerScale). Frame attention over one frame's patch tokens:
bidirectional.

This file: correct (qk_norm per-head LayerNorm, 8 heads of 8, fused SDPA path, bidirectional)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features, act_layer=nn.GELU, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class RotaryPositionEmbedding2D(nn.Module):
    """VGGT's 2D rotary embedding: the head is cut in two; the first half is rotated by the patch row
    (y), the second half by the patch column (x), each half with rotate-half 1D RoPE."""

    def __init__(self, frequency: float = 100.0, scaling_factor: float = 1.0):
        super().__init__()
        self.base_frequency = frequency
        self.scaling_factor = scaling_factor

    def _compute_frequency_components(self, dim, seq_len, dtype):
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        inv_freq = 1.0 / (self.base_frequency**exponents)
        positions = torch.arange(seq_len, dtype=torch.float64)
        angles = torch.einsum("i,j->ij", positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def _rotate_features(x):
        feature_dim = x.shape[-1]
        x1, x2 = x[..., : feature_dim // 2], x[..., feature_dim // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def _apply_1d_rope(self, tokens, positions, cos_comp, sin_comp):
        cos = F.embedding(positions, cos_comp)[:, None, :, :]
        sin = F.embedding(positions, sin_comp)[:, None, :, :]
        return (tokens * cos) + (self._rotate_features(tokens) * sin)

    def forward(self, tokens, positions):
        feature_dim = tokens.size(-1) // 2
        max_position = int(positions.max()) + 1
        cos_comp, sin_comp = self._compute_frequency_components(feature_dim, max_position, tokens.dtype)
        vertical_features, horizontal_features = tokens.chunk(2, dim=-1)
        vertical_features = self._apply_1d_rope(vertical_features, positions[..., 0], cos_comp, sin_comp)
        horizontal_features = self._apply_1d_rope(horizontal_features, positions[..., 1], cos_comp, sin_comp)
        return torch.cat((vertical_features, horizontal_features), dim=-1)


class Attention(nn.Module):
    """VGGT / DINOv2 attention: fused qkv Linear reshaped (B, N, 3, heads, head_dim) and permuted,
    optional per-head q_norm/k_norm (LayerNorm over head_dim), optional rope(q, pos), either
    F.scaled_dot_product_attention (fused_attn) or the explicit q*scale @ k^T softmax path, proj."""

    def __init__(self, dim, num_heads=8, qkv_bias=True, qk_norm=False, attn_drop=0.0, proj_drop=0.0,
                 proj_bias=True, norm_layer=nn.LayerNorm, fused_attn=True, rope=None):
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rope = rope

    def forward(self, x: Tensor, pos=None) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        if self.rope is not None:
            q = self.rope(q, pos)
            k = self.rope(k, pos)

        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=2.0, qkv_bias=True, proj_bias=True, init_values=0.01,
                 qk_norm=False, fused_attn=True, rope=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias,
                              qk_norm=qk_norm, fused_attn=fused_attn, rope=rope)
        self.ls1 = LayerScale(dim, init_values=init_values)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), bias=proj_bias)
        self.ls2 = LayerScale(dim, init_values=init_values)

    def forward(self, x, pos=None):
        x = x + self.ls1(self.attn(self.norm1(x), pos=pos))
        x = x + self.ls2(self.mlp(self.norm2(x)))
        return x


class Aggregator(nn.Module):
    """The frame-attention half of VGGT's alternating-attention aggregator, fed patch tokens of one
    frame directly: (B, N, C) -> (B, N, C)."""

    def __init__(self, embed_dim=64, num_heads=4, qk_norm=True, fused_attn=True, use_rope=False,
                 patch_grid_w=4):
        super().__init__()
        self.rope = RotaryPositionEmbedding2D(frequency=100.0) if use_rope else None
        self.patch_grid_w = patch_grid_w
        self.frame_blocks = nn.ModuleList(
            [Block(embed_dim, num_heads, qk_norm=qk_norm, fused_attn=fused_attn, rope=self.rope)]
        )

    def forward(self, tokens):
        B, N, C = tokens.shape
        pos = None
        if self.rope is not None:
            idx = torch.arange(N, device=tokens.device)
            pos = torch.stack([idx // self.patch_grid_w, idx % self.patch_grid_w], dim=-1)
            pos = pos.unsqueeze(0).expand(B, N, 2)
        for blk in self.frame_blocks:
            tokens = blk(tokens, pos=pos)
        return tokens


def make_vggt_frame_attention():
    torch.manual_seed(3105)
    model = Aggregator(embed_dim=64, num_heads=8, qk_norm=True, fused_attn=True)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, LayerScale):
                mod.gamma.uniform_(0.5, 1.0)
    return model.eval()



EXPECT = {'target': 'make_vggt_frame_attention',
 'kind': 'multihead',
 'ok': True,
 'layer': 'frame_blocks.0.attn',
 'structure': {'heads': 8,
               'kv_heads': 8,
               'head_dim': 8,
               'causal': False,
               'cross': False,
               'rope': None,
               'qk_norm': 'per-head',
               'window': None,
               'bias': None},
 'style': 'VGGT frame Attention (facebookresearch/vggt vggt/layers/attention.py): correct (qk_norm '
          'per-head LayerNorm, 8 heads of 8, fused SDPA path, bidirectional)'}
