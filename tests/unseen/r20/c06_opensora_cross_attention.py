"""Open-Sora style (hpcaitech/Open-Sora, opensora/models/layers/blocks.py): the cross-attention onto the text condition.
MultiHeadCrossAttention has q_linear on the video tokens and one kv_linear on the text condition,
split to k/v; Attention (the temporal/spatial self-attention) has a fused qkv, per-head q_norm/k_norm
(LlamaRMSNorm over head_dim) and a rope callable from rotary_embedding_torch (interleaved pairs,
rotate_half on (d r) -> d r pairs), non-causal; both end in proj. The wrappers are STDiT-like blocks.

This file: correct (cross-attention, 4 heads, kv_linear on the condition)"""

import math

import torch
from torch import nn


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class RotaryEmbedding(nn.Module):
    """rotary_embedding_torch.RotaryEmbedding(dim): freqs repeated per pair, rotate_half on pairs."""

    def __init__(self, dim, theta=10000.0):
        super().__init__()
        self.register_buffer("freqs", 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), persistent=False)

    def rotate_queries_or_keys(self, t):
        n = t.shape[-2]
        f = torch.arange(n, dtype=torch.float64, device=t.device)[:, None] * self.freqs[None, :]
        f = f.repeat_interleave(2, dim=-1).to(t.dtype)
        x = t.unflatten(-1, (-1, 2))
        x1, x2 = x.unbind(-1)
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return t * f.cos() + rot * f.sin()


class Attention(nn.Module):
    def __init__(self, dim, num_heads=4, qkv_bias=True, qk_norm=True, rope=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = LlamaRMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = LlamaRMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.rotary_emb = rope

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q = self.rotary_emb(q)
            k = self.rotary_emb(k)
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.proj = nn.Linear(d_model, d_model)
        self.gate = nn.Linear(d_model, d_model) if False else None

    def forward(self, x, cond):
        x_in = x
        B, N, C = x.shape
        M = cond.shape[1]
        q = self.q_linear(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.kv_linear(cond).view(B, -1, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        attn = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim), dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        if self.gate is not None:
            x = x * torch.sigmoid(self.gate(x_in))
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, rope=RotaryEmbedding(dim // heads).rotate_queries_or_keys)

    def forward(self, x):
        return x + self.attn(self.norm1(x))


def _init(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.uniform_(0.5, 1.5)
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.7, 1.3)
                m.bias.uniform_(-0.1, 0.1)
    return model.eval()


def make_opensora_cross():
    torch.manual_seed(2031)
    return _init(MultiHeadCrossAttention(64, 4))


EXPECT = {'target': 'make_opensora_cross',
 'kind': 'cross',
 'ok': True,
 'layer': '',
 'structure': {'heads': 4,
               'kv_heads': 4,
               'head_dim': 16,
               'causal': False,
               'cross': True,
               'rope': None,
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'Open-Sora (hpcaitech) blocks.py Attention / MultiHeadCrossAttention: correct '
          '(cross-attention, 4 heads, kv_linear on the condition)'}
