"""PVTv2 (whai362/PVT) spatial-reduction Attention inside a Block and a stage wrapper: q Linear, fused kv
Linear reshaped (B, N, 2, heads, d).permute(2, 0, 3, 1, 4), (q @ k^T) * scale, softmax, proj.
Tokens are a (H, W) = (N, 1) strip of patches.

This file: one bug, the fused kv is reshaped with the pair axis first."""

import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(
        self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0
    ):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x, H, W):
        x = self.drop(self.act(self.fc1(x)))
        return self.drop(self.fc2(x))


class Attention(nn.Module):
    def __init__(
        self,
        dim,
        num_heads=8,
        qkv_bias=False,
        qk_scale=None,
        attn_drop=0.0,
        proj_drop=0.0,
        sr_ratio=1,
        linear=False,
    ):
        super().__init__()
        assert dim % num_heads == 0, f"dim {dim} should be divided by num_heads {num_heads}."
        self.dim = dim
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim**-0.5

        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

        self.linear = linear
        self.sr_ratio = sr_ratio
        if not linear:
            if sr_ratio > 1:
                self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
                self.norm = nn.LayerNorm(dim)
        else:
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.sr = nn.Conv2d(dim, dim, kernel_size=1, stride=1)
            self.norm = nn.LayerNorm(dim)
            self.act = nn.GELU()

    def forward(self, x, H, W):
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)

        if not self.linear:
            if self.sr_ratio > 1:
                x_ = x.permute(0, 2, 1).reshape(B, C, H, W)
                x_ = self.sr(x_).reshape(B, C, -1).permute(0, 2, 1)
                x_ = self.norm(x_)
                kv = (
                    self.kv(x_)
                    .reshape(B, -1, 2, self.num_heads, C // self.num_heads)
                    .permute(2, 0, 3, 1, 4)
                )
            else:
                kv = (
                    self.kv(x)
                    .reshape(B, 2, self.num_heads, -1, C // self.num_heads)
                    .permute(1, 0, 2, 3, 4)
                )
        else:
            x_ = x.permute(0, 2, 1).reshape(B, C, H, W)
            x_ = self.sr(self.pool(x_)).reshape(B, C, -1).permute(0, 2, 1)
            x_ = self.norm(x_)
            x_ = self.act(x_)
            kv = (
                self.kv(x_)
                .reshape(B, -1, 2, self.num_heads, C // self.num_heads)
                .permute(2, 0, 3, 1, 4)
            )
        k, v = kv[0], kv[1]

        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Block(nn.Module):
    def __init__(
        self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, qk_scale=None, sr_ratio=1, linear=False
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(
            dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            qk_scale=qk_scale,
            sr_ratio=sr_ratio,
            linear=linear,
        )
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio))

    def forward(self, x, H, W):
        x = x + self.attn(self.norm1(x), H, W)
        x = x + self.mlp(self.norm2(x), H, W)
        return x


class PyramidVisionStage(nn.Module):
    """One PVTv2 stage after its patch embedding: tokens are a (H, W) = (N, 1) strip of patches."""

    def __init__(self, dim=64, num_heads=4, depth=1, sr_ratio=1, linear=False):
        super().__init__()
        self.block1 = nn.ModuleList(
            [
                Block(dim, num_heads, qkv_bias=True, sr_ratio=sr_ratio, linear=linear)
                for _ in range(depth)
            ]
        )
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x):
        H, W = x.shape[1], 1
        for blk in self.block1:
            x = blk(x, H, W)
        return self.norm1(x)


def make_pvt_stage():
    torch.manual_seed(1431)
    model = PyramidVisionStage()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.6, 1.4)
                mod.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_pvt_stage",
    "kind": "multihead",
    "ok": False,
    "layer": "block1.0.attn",
    "stage": "keys",
    "mistake": "heads_split",
    "style": "PVTv2 Attention: kv reshaped (B, 2, heads, -1, d).permute(1, 0, 2, 3, 4), the fused kv "
    "viewed pair-first, mixing tokens and features",
}
