"""A small GPT with an appending KV cache that is updated twice from every call.

Its ``KVCache.update`` appends the new keys and values to what a layer slot holds; a refactor
moved the update into the block and left the model's own call in place, so every call adds
its keys and values twice: after the prompt the cache holds the prompt twice, and the first
cached step attends over each prompt token twice. Every layer is right without the cache;
decoding is ``cache_stale`` (the cache updated twice), not a mask problem.
"""

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "kind": "model",
    "ok": False,
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "blocks.0.attn"},
}


class KVCache:
    def __init__(self, n_layers):
        self.slots = [None] * n_layers

    def get(self, i):
        return self.slots[i]

    def update(self, i, kv):  # appends
        if self.slots[i] is None:
            self.slots[i] = kv
        else:
            self.slots[i] = tuple(
                torch.cat([old, new], dim=2) for old, new in zip(self.slots[i], kv, strict=True)
            )


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
        return self.proj(y), (k[:, :, -n:], v[:, :, -n:])  # the new tokens' keys and values


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, past=None, cache=None, i=None):
        a, kv = self.attn(self.ln1(x), past)
        if cache is not None:
            cache.update(i, kv)
        x = x + a
        return x + self.mlp(self.ln2(x)), kv


class GPT(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4, layers=3, context=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
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
            x, kv = block(x, past, cache if use_cache else None, i)
            if use_cache and cache is not None:
                cache.update(i, kv)  # bug: the block has already stored them
        return self.head(self.ln_f(x))

    def reset_kv_cache(self):
        self.current_pos = 0


def make_model():
    torch.manual_seed(0)
    return GPT()
