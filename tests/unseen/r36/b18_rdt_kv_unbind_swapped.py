"""RDT block (in the manner of thu-ml/RoboticsDiffusionTransformer models/rdt/blocks.py, RDTBlock):
timm-style self-attention over the action/state tokens (fused qkv with bias, per-head qk_norm),
then CrossAttention to the condition tokens (language or image features): q from the tokens, one
fused kv projection from the condition reshaped to (2, heads), per-head q_norm/k_norm, fused
scaled_dot_product_attention or the eager q * scale @ k^T path, proj with bias. Pre-RmsNorm
residual block with a tanh-GELU MLP. The target takes (hidden, context); the checked layer is the
cross-attention.

This file: one bug: v, k = kv.unbind(0): keys from the value half of the fused kv weights and
vice versa."""

import torch
import torch.nn.functional as F
from torch import nn


class RDTConfig:
    hidden_size = 64
    num_heads = 8
    qk_norm = "layernorm"
    fused_attn = False
    mlp_ratio = 2


class RmsNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_qk_norm(kind, head_dim):
    if kind == "layernorm":
        return nn.LayerNorm(head_dim, eps=1e-6)
    return RmsNorm(head_dim)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm = make_qk_norm(config.qk_norm, self.head_dim)
        self.k_norm = make_qk_norm(config.qk_norm, self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class CrossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = config.fused_attn
        self.q = nn.Linear(dim, dim, bias=True)
        self.kv = nn.Linear(dim, dim * 2, bias=True)
        self.q_norm = make_qk_norm(config.qk_norm, self.head_dim)
        self.k_norm = make_qk_norm(config.qk_norm, self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x, c, mask=None):
        B, N, C = x.shape
        _, L, _ = c.shape
        q = self.q(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        kv = self.kv(c).reshape(B, L, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        v, k = kv.unbind(0)
        q = self.q_norm(q)
        k = self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            if mask is not None:
                attn = attn.masked_fill(~mask, float("-inf"))
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.permute(0, 2, 1, 3).reshape(B, N, C)
        x = self.proj_drop(self.proj(x))
        return x


class Mlp(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size * config.mlp_ratio
        self.fc1 = nn.Linear(config.hidden_size, hidden)
        self.fc2 = nn.Linear(hidden, config.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class RDTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = RmsNorm(config.hidden_size)
        self.attn = Attention(config)
        self.norm2 = RmsNorm(config.hidden_size)
        self.cross_attn = CrossAttention(config)
        self.norm3 = RmsNorm(config.hidden_size)
        self.ffn = Mlp(config)

    def forward(self, x, c, mask=None):
        x = x + self.attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), c, mask)
        return x + self.ffn(self.norm3(x))


def make_rdt_block():
    torch.manual_seed(3628)
    block = RDTBlock(RDTConfig())
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, (RmsNorm, nn.LayerNorm)):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, (nn.LayerNorm, nn.Linear)) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_rdt_block",
    "kind": "cross",
    "ok": False,
    "layer": "cross_attn",
    "stage": "keys",
    "mistake": "wrong_projection",
    "style": "RDT CrossAttention (RDTBlock): one bug: v, k = kv.unbind(0): keys made with "
    "the value weights",
}
