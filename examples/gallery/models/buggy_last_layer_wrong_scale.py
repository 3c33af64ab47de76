"""A small GPT whose last layer takes a fused fast path with the wrong scale.

Layers 0 and 1 compute attention by hand; the last layer (``blocks.2.attn``, written later
as a "fast path") calls ``scaled_dot_product_attention`` with ``scale=1/sqrt(d_model)``, the
model width, instead of the head size. The first failing layer is ``blocks.2.attn``, at
``scaled_scores``; cached decoding still equals the (equally wrong) full pass.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "kind": "model",
    "ok": False,
    "layer": "blocks.2.attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "decode": "ok",
}


class KVCache:
    def __init__(self, n_layers):
        self.slots = [None] * n_layers

    def get(self, i):
        return self.slots[i]

    def update(self, i, kv):
        self.slots[i] = kv


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, past=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        total = k.shape[2]
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        rows = torch.arange(total - n, total)[:, None]
        scores = scores.masked_fill(torch.arange(total)[None, :] > rows, float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, d)
        return self.proj(y), (k, v)


class FastCausalSelfAttention(CausalSelfAttention):
    def forward(self, x, past=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        y = nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=past is None,
            scale=1 / math.sqrt(d),  # bug: d, not head_dim
        )
        return self.proj(y.transpose(1, 2).reshape(b, n, d)), (k, v)


class Block(nn.Module):
    def __init__(self, d, heads, fast=False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = (FastCausalSelfAttention if fast else CausalSelfAttention)(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, past=None):
        a, kv = self.attn(self.ln1(x), past)
        x = x + a
        return x + self.mlp(self.ln2(x)), kv


class GPT(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4, layers=3, context=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, fast=i == layers - 1) for i in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.current_pos = 0

    def forward(self, ids, use_cache=False, cache=None):
        n = ids.shape[1]
        start = self.current_pos if use_cache else 0
        if use_cache:
            self.current_pos += n
        x = self.tok(ids) + self.pos(torch.arange(start, start + n))
        for i, block in enumerate(self.blocks):
            past = cache.get(i) if use_cache and cache is not None else None
            x, kv = block(x, past)
            if use_cache and cache is not None:
                cache.update(i, kv)
        return self.head(self.ln_f(x))

    def reset_kv_cache(self):
        self.current_pos = 0


def make_model():
    torch.manual_seed(0)
    return GPT()
