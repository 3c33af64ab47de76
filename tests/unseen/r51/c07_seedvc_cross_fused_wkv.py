"""Seed-VC (Plachtaa) DiT cross-attention block (the has_cross_attention option of its gpt-fast
derived transformer): queries from the latent sequence through wq, keys and values from the
condition/prompt features through one fused wkv projection, no rotary, no mask, eager core, out
projection wo. The target block takes (hidden, context) = (latents, condition features).
4 heads of 16, bias-free wq / wkv / wo, RMSNorm on both inputs in the block.

This file: correct (4 heads, wq on the latents, fused wkv on the condition, eager)"""

import math

import torch
from torch import nn


class ModelArgs:
    dim = 64
    context_dim = 64
    n_head = 4
    norm_eps = 1e-5

    @property
    def head_dim(self):
        return self.dim // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight


class CrossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.dim = config.dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wkv = nn.Linear(config.context_dim, 2 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x, context):
        bsz, seqlen, _ = x.shape
        ctx_len = context.shape[1]
        q = self.wq(x).view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.wkv(context).split([self.dim, self.dim], dim=-1)
        k = k.view(bsz, ctx_len, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(bsz, ctx_len, self.n_head, self.head_dim).transpose(1, 2)

        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        attn = torch.softmax(scores, dim=-1)
        y = torch.matmul(attn, v)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class CrossBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cross_attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.context_norm = RMSNorm(config.context_dim, config.norm_eps)
        self.cross_attention = CrossAttention(config)

    def forward(self, x, context):
        return x + self.cross_attention(self.cross_attention_norm(x), self.context_norm(context))


def make_seedvc_cross():
    torch.manual_seed(5107)
    model = CrossBlock(ModelArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_seedvc_cross",
    "kind": "cross",
    "ok": True,
    "layer": "cross_attention",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Seed-VC (Plachtaa) DiT cross-attention: correct (4 heads, wq on the latents, fused "
    "wkv on the condition, eager)",
}
