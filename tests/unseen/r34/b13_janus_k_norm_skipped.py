"""DeepSeek Janus vision tower (deepseek-ai/Janus janus/models/siglip_vit.py, a timm VisionTransformer
port): Attention with one fused qkv Linear (qkv_bias), reshape(B, N, 3, heads, head_dim) +
permute(2, 0, 3, 1, 4) + unbind, optional per-head q_norm/k_norm (norm_layer(head_dim), LayerNorm),
either F.scaled_dot_product_attention (fused_attn) or the explicit q * scale @ k^T softmax path,
transpose + reshape merge, proj Linear; pre-norm Block with LayerNorm and a GELU Mlp; bidirectional.
Patch embedding omitted: the trunk takes token vectors.

This file: one bug: the norm line is written q = self.q_norm(q): the keys skip their k_norm (LayerNorm(16)) although the layer builds it"""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        dim,
        num_heads=8,
        qkv_bias=False,
        qk_norm=False,
        norm_layer=nn.LayerNorm,
        fused_attn=True,
    ):
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = (
            self.qkv(x)
            .reshape(B, N, 3, self.num_heads, self.head_dim)
            .permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv.unbind(0)
        q = self.q_norm(q)

        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return x


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias, qk_norm, fused_attn):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, fused_attn=fused_attn
        )
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, dim * 2)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class VisionTransformer(nn.Module):
    def __init__(self, embed_dim=64, depth=1, num_heads=4, qkv_bias=True, qk_norm=False,
                 fused_attn=True):
        super().__init__()
        self.blocks = nn.Sequential(
            *[Block(embed_dim, num_heads, qkv_bias, qk_norm, fused_attn) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x):
        x = self.blocks(x)
        return self.norm(x)


def make_janus_siglip_vit():
    torch.manual_seed(3554)
    model = VisionTransformer(
        embed_dim=64, depth=1, num_heads=4, qkv_bias=True, qk_norm=True, fused_attn=True
    )
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_janus_siglip_vit",
    "kind": "multihead",
    "ok": False,
    "layer": "blocks.0.attn",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "DeepSeek Janus siglip_vit Attention (deepseek-ai/Janus janus/models/siglip_vit.py): one bug: the norm line is written q = self.q_norm(q): the keys skip their k_norm (LayerNorm(16)) although the layer builds it",
}
