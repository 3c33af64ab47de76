"""A timm VisionTransformer (vision_transformer.py) run over token ids instead of patches.

timm's Attention: fused qkv Linear with bias reshaped (B, N, 3, H, hd).permute(2, 0, 3, 1, 4),
per-head q_norm/k_norm LayerNorms (qk_norm=True), q = q * scale before q @ k^T, proj.  Blocks with
norm1/attn/ls1 (LayerScale gamma)/norm2/mlp/ls2 in an nn.Sequential, a cls_token prepended and a
learned pos_embed over cls + tokens, final norm and a per-token head (the cls position is dropped
from the output).  Bidirectional, no cache.  d 96, 6 heads of 16.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"],
    "kind": "multihead",
    "cache": None,
    "structure": {
        "heads": 6,
        "kv_heads": 6,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "timm vision_transformer.py over token ids: Attention with fused qkv (B,N,3,H,hd) permute, per-head LayerNorm "
    "q_norm/k_norm, q*scale before the product, LayerScale ls1/ls2, cls_token + pos_embed, nn.Sequential blocks",
}


class Attention(nn.Module):
    fused_attn = False

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, norm_layer=nn.LayerNorm):
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


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


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=True, qk_norm=True, init_values=0.5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm)
        self.ls1 = LayerScale(dim, init_values=init_values)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim, init_values=init_values)

    def forward(self, x):
        x = x + self.ls1(self.attn(self.norm1(x)))
        x = x + self.ls2(self.mlp(self.norm2(x)))
        return x


class TokenVisionTransformer(nn.Module):
    def __init__(self, vocab_size=150, embed_dim=96, depth=3, num_heads=6, max_tokens=64):
        super().__init__()
        self.patch_embed = nn.Embedding(vocab_size, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, max_tokens + 1, embed_dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, vocab_size)

    def forward(self, input_ids):
        x = self.patch_embed(input_ids)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed[:, : x.shape[1]]
        x = self.blocks(x)
        x = self.norm(x)
        return self.head(x[:, 1:])


def make_model():
    torch.manual_seed(705)
    model = TokenVisionTransformer()
    with torch.no_grad():
        model.patch_embed.weight.normal_(0.0, 0.5)
        model.cls_token.normal_(0.0, 0.5)
        model.pos_embed.normal_(0.0, 0.3)
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.08)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.05)
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
            elif isinstance(m, LayerScale):
                m.gamma.copy_(0.5 + 0.2 * torch.randn_like(m.gamma))
    return model.eval()
