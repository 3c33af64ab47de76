"""A small decoder whose attention is a hand-written FlashAttention-1 style loop in plain PyTorch.

Written like the "flash attention from scratch" tutorials: for each block of KEY_BLOCK keys the
loop keeps a running row maximum `m_i`, a running normaliser `l_i` and an unnormalised accumulator
`acc`; each block's exp(s - m_new) is added after rescaling the old ones by exp(m_old - m_new),
and the context is acc / l_i at the end.  That is exactly softmax(QK^T / sqrt(d)) V (no
approximation), just computed block by block.  The causal mask is applied per block from absolute
query and key positions (the query positions start at the cache length).

Module tree: `embed`, `stack.N` (DecoderBlock: pre_norm, attention, post_norm, mlp), `final_norm`,
`unembed`.  OnlineSoftmaxAttention: separate `to_q`, `to_k`, `to_v`, `to_out`, MHA 4 heads of 16,
rotary with rotate-half pairing (base 10000) computed on the fly from positions.
Cache: external `cache = KVCache(n_layers)` passed as `model(ids, cache=cache)`; `cache.get(i)` /
`cache.update(i, (k, v))` hold the rotated keys and values (b, h, s, d); the offset is the
cache's stored length.  `model.reset_kv_cache()` exists and does nothing (a new KVCache is the reset).
"""

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["stack.0.attention", "stack.1.attention", "stack.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "hand-written FlashAttention-1 loop: online softmax over key blocks of 5 (running max, running sum, "
    "rescaled accumulator), per-block causal mask from absolute positions, rotate-half rotary; external "
    "KVCache(n_layers) get/update; stack.N.attention with to_q/to_k/to_v/to_out",
}

KEY_BLOCK = 5


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[2]

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_angles(head_dim, positions, base, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def online_softmax_attention(q, k, v, q_pos, k_pos, scale, block=KEY_BLOCK):
    """q (b, h, tq, d), k/v (b, h, tk, d); q_pos (tq,), k_pos (tk,) absolute positions."""
    b, h, tq, d = q.shape
    m_i = torch.full((b, h, tq, 1), float("-inf"), dtype=q.dtype, device=q.device)
    l_i = torch.zeros((b, h, tq, 1), dtype=q.dtype, device=q.device)
    acc = torch.zeros((b, h, tq, v.shape[-1]), dtype=q.dtype, device=q.device)
    for start in range(0, k.shape[2], block):
        kb = k[:, :, start : start + block]
        vb = v[:, :, start : start + block]
        s = torch.matmul(q, kb.transpose(-1, -2)) * scale
        visible = k_pos[start : start + block][None, :] <= q_pos[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m_i - m_safe)
        l_i = alpha * l_i + p.sum(dim=-1, keepdim=True)
        acc = alpha * acc + torch.matmul(p, vb)
        m_i = m_new
    return acc / l_i


class OnlineSoftmaxAttention(nn.Module):
    def __init__(self, d_model, n_heads, layer_idx, base=10000.0):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.layer_idx = layer_idx
        self.base = base
        self.to_q = nn.Linear(d_model, d_model, bias=False)
        self.to_k = nn.Linear(d_model, d_model, bias=False)
        self.to_v = nn.Linear(d_model, d_model, bias=False)
        self.to_out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, cache: Optional[KVCache] = None, start: int = 0):
        b, t, _ = x.shape
        split = lambda z: z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q, k, v = split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x))
        q_pos = torch.arange(start, start + t, device=x.device)
        cos, sin = rope_angles(self.head_dim, q_pos, self.base, x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            prev = cache.get(self.layer_idx)
            if prev is not None:
                k = torch.cat([prev[0], k], dim=2)
                v = torch.cat([prev[1], v], dim=2)
            cache.update(self.layer_idx, (k, v))
        k_pos = torch.arange(k.shape[2], device=x.device)
        ctx = online_softmax_attention(q, k, v, q_pos, k_pos, 1.0 / math.sqrt(self.head_dim))
        return self.to_out(ctx.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    def __init__(self, d_model, n_heads, layer_idx):
        super().__init__()
        self.pre_norm = nn.LayerNorm(d_model)
        self.attention = OnlineSoftmaxAttention(d_model, n_heads, layer_idx)
        self.post_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x, cache, start):
        x = x + self.attention(self.pre_norm(x), cache=cache, start=start)
        return x + self.mlp(self.post_norm(x))


class FlashDecoder(nn.Module):
    def __init__(self, vocab=140, d_model=64, n_heads=4, n_layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.stack = nn.ModuleList([DecoderBlock(d_model, n_heads, i) for i in range(n_layers)])
        self.final_norm = nn.LayerNorm(d_model)
        self.unembed = nn.Linear(d_model, vocab, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, ids, cache: Optional[KVCache] = None):
        start = cache.seq_len() if cache is not None else 0
        x = self.embed(ids)
        for blk in self.stack:
            x = blk(x, cache, start)
        return self.unembed(self.final_norm(x))


def make_model():
    torch.manual_seed(803)
    model = FlashDecoder()
    g = torch.Generator().manual_seed(8031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
