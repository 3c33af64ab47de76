"""Differential attention (Diff Transformer, MultiheadDiffAttn), written from scratch without
the flash/rotary kernels.

Each of the 4 heads owns two query/key halves (8 of 16 dims each); the two causal softmax maps
are subtracted with a learned, re-parameterised lambda (exp(lq1.lk1) - exp(lq2.lk2) + lambda_init),
the head output goes through a per-head RMSNorm (subln) and is scaled by (1 - lambda_init)
before out_proj. Not textbook attention: the weights are a difference of two softmaxes.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def lambda_init_fn(depth):
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MultiheadDiffAttn(nn.Module):
    def __init__(self, embed_dim=64, depth=1, num_heads=4):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads // 2
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.lambda_init = lambda_init_fn(depth)
        self.lambda_q1 = nn.Parameter(torch.zeros(self.head_dim).normal_(mean=0, std=0.1))
        self.lambda_k1 = nn.Parameter(torch.zeros(self.head_dim).normal_(mean=0, std=0.1))
        self.lambda_q2 = nn.Parameter(torch.zeros(self.head_dim).normal_(mean=0, std=0.1))
        self.lambda_k2 = nn.Parameter(torch.zeros(self.head_dim).normal_(mean=0, std=0.1))
        self.subln = RMSNorm(2 * self.head_dim, eps=1e-5)

    def forward(self, x):
        bsz, tgt_len, _ = x.size()
        src_len = tgt_len
        q = self.q_proj(x).view(bsz, tgt_len, 2 * self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, src_len, 2 * self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, src_len, self.num_heads, 2 * self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(q * self.scaling, k.transpose(-1, -2))
        attn_mask = torch.triu(torch.full((tgt_len, src_len), float("-inf"), dtype=x.dtype), 1)
        attn_weights = F.softmax(attn_weights + attn_mask, dim=-1)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1))
        lambda_full = lambda_1 - lambda_2 + self.lambda_init
        attn_weights = attn_weights.view(bsz, self.num_heads, 2, tgt_len, src_len)
        attn_weights = attn_weights[:, :, 0] - lambda_full * attn_weights[:, :, 1]
        attn = torch.matmul(attn_weights, v)
        attn = self.subln(attn) * (1 - self.lambda_init)
        attn = attn.transpose(1, 2).reshape(bsz, tgt_len, self.num_heads * 2 * self.head_dim)
        return self.out_proj(attn)


class DiffBlock(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.self_attn_layer_norm = RMSNorm(dim)
        self.self_attn = MultiheadDiffAttn(dim, depth=1, num_heads=4)

    def forward(self, x):
        return x + self.self_attn(self.self_attn_layer_norm(x))


def make_diff_block():
    torch.manual_seed(1040)
    block = DiffBlock()
    with torch.no_grad():
        block.self_attn_layer_norm.weight.uniform_(0.5, 1.5)
        block.self_attn.subln.weight.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {
    "target": "make_diff_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "unsupported": "differential_attention",
    "style": "Diff Transformer MultiheadDiffAttn (two softmax maps per head subtracted with a re-parameterised lambda, "
    "per-head RMSNorm subln, (1 - lambda_init) scale), causal, without rotary",
}
