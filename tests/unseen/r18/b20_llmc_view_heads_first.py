"""Karpathy's llm.c GPT-2 forward pass (`train_gpt2.c`: matmul_forward + attention_forward), ported to torch.

The parameters keep llm.c's names and layouts: `qkvw` (3C, C) and `qkvb`, `attprojw` (C, C) and
`attprojb`, applied as `inp @ w^T + b` like matmul_forward. attention_forward reads query, key and
value at offsets 0, C and 2C of the (B, T, 3C) buffer, head h at h*hs, computes `preatt` with
scale 1/sqrt(hs) only for t2 <= t, takes the running max, `expf(preatt - maxval)`, sums, normalises
with `expsum_inv` and accumulates the value vectors. The C loops over b, t and h are vectorised; the
skipped t2 > t entries become explicit zeros. The block applies llm.c's layernorm_forward first.

This file: one bug: the query/key/value slices are viewed (B, NH, T, hs) directly, without the (B, T, NH, hs) view and permute."""

import math

import torch
from torch import nn


def matmul_forward(inp, weight, bias):
    out = inp @ weight.t()
    return out + bias if bias is not None else out


def attention_forward(inp, NH):
    B, T, C3 = inp.shape
    C = C3 // 3
    hs = C // NH
    query_t = inp[..., 0:C].reshape(B, NH, T, hs)
    key_t = inp[..., C:2 * C].reshape(B, NH, T, hs)
    value_t = inp[..., 2 * C:].reshape(B, NH, T, hs)
    scale = 1.0 / math.sqrt(hs)
    preatt = (query_t @ key_t.transpose(-1, -2)) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=inp.device).tril()
    # pass 1: maxval over t2 <= t; pass 2: expf and expsum; pass 3: normalise (t2 > t stay 0)
    maxval = torch.where(causal, preatt, torch.full_like(preatt, -10000.0)).amax(-1, keepdim=True)
    expv = torch.where(causal, torch.exp(preatt - maxval), torch.zeros_like(preatt))
    expsum_inv = 1.0 / expv.sum(-1, keepdim=True)
    att = expv * expsum_inv
    out = att @ value_t
    return out.permute(0, 2, 1, 3).reshape(B, T, C)


class LlmcAttention(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.qkvw = nn.Parameter(torch.randn(3 * C, C) * 0.15)
        self.qkvb = nn.Parameter(torch.randn(3 * C) * 0.05)
        self.attprojw = nn.Parameter(torch.randn(C, C) * 0.15)
        self.attprojb = nn.Parameter(torch.randn(C) * 0.05)

    def forward(self, inp):
        qkv = matmul_forward(inp, self.qkvw, self.qkvb)
        atty = attention_forward(qkv, self.NH)
        return matmul_forward(atty, self.attprojw, self.attprojb)


class GPT2Block(nn.Module):
    def __init__(self, C=64, NH=4):
        super().__init__()
        self.ln1w = nn.Parameter(torch.empty(C).uniform_(0.5, 1.5))
        self.ln1b = nn.Parameter(torch.empty(C).uniform_(-0.2, 0.2))
        self.attn = LlmcAttention(C, NH)

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        ln = (x - mean) * torch.rsqrt(var + 1e-5) * self.ln1w + self.ln1b
        return x + self.attn(ln)


def make_llmc_block():
    torch.manual_seed(1844)
    return GPT2Block(64, 4).eval()


EXPECT = {'target': 'make_llmc_block',
 'kind': 'causal-multihead',
 'layer': 'attn',
 'ok': False,
 'stage': 'queries',
 'mistake': 'heads_split',
 'style': 'llm.c port: inp[..., 0:C].view(B, NH, T, hs), cutting heads across tokens'}
