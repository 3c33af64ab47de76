"""A tiny GPT in the style of Karpathy's nanochat (nanochat/gpt.py + engine.py KVCache).

GPT -> transformer ModuleDict(wte, h ModuleList of Block(attn, mlp)) + untied lm_head.
No learnable norm parameters anywhere: norm(x) = F.rms_norm(x, (x.size(-1),)).
CausalSelfAttention: separate c_q/c_k/c_v/c_proj, rotary on halves with nanochat's sign
convention (y1 = x1*cos + x2*sin, y2 = -x1*sin + x2*cos: a rotation by minus the angle),
then a parameter-free per-head QK RMS norm *after* the rotation (norm and rotation commute,
so this is the same as norming first), GQA 4/2 through SDPA enable_gqa.  Three SDPA paths
as in nanochat: is_causal when Tq == Tk, no mask for a single query, a prefix+tril mask for
a chunk.  Relu^2 MLP, embedding normed after lookup, logits soft-capped at 15 (logits
only).  The KV cache is an external object (book-cache): one preallocated tensor
(n_layers, 2, B, kv_heads, T, head_dim) allocated on first insert; its pos advances after
the last layer.  Correct.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000.0},
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "nanochat gpt.py: functional rms_norm, rotary with negative-angle sign convention, QK norm "
    "after rotary (parameter-free, commutes), SDPA enable_gqa with three mask paths, KVCache.insert_kv",
}


@dataclass
class GPTConfig:
    sequence_len: int = 64
    vocab_size: int = 128
    n_layer: int = 3
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary_emb(x, cos, sin):
    assert x.ndim == 4
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    out = torch.cat([y1, y2], 3)
    return out.to(x.dtype)


class KVCache:
    """Book-cache object: KVCache(n_layers=...) then pass cache=... to the model."""

    def __init__(self, n_layers, batch_size=None, num_heads=2, seq_len=64, head_dim=16):
        self.num_layers = n_layers
        self.batch_size = batch_size
        self.num_heads = num_heads
        self.seq_len = seq_len
        self.head_dim = head_dim
        self.kv_cache = None
        self.pos = 0

    def reset(self):
        self.pos = 0
        self.kv_cache = None

    def get_pos(self):
        return self.pos

    def insert_kv(self, layer_idx, k, v):
        B, H, T_add, D = k.size()
        if self.kv_cache is None:
            shape = (self.num_layers, 2, B, H, self.seq_len, D)
            self.kv_cache = torch.empty(shape, dtype=k.dtype, device=k.device)
        t0, t1 = self.pos, self.pos + T_add
        if t1 > self.kv_cache.size(4):
            t_needed = t1 + 1024
            t_needed = (t_needed + 1023) & ~1023
            additional = list(self.kv_cache.shape)
            additional[4] = t_needed - self.kv_cache.size(4)
            self.kv_cache = torch.cat(
                [self.kv_cache, torch.empty(additional, dtype=k.dtype, device=k.device)], dim=4
            )
        self.kv_cache[layer_idx, 0, :, :, t0:t1] = k.detach()
        self.kv_cache[layer_idx, 1, :, :, t0:t1] = v.detach()
        key_view = self.kv_cache[layer_idx, 0, :, :, :t1]
        value_view = self.kv_cache[layer_idx, 1, :, :, :t1]
        if layer_idx == self.num_layers - 1:
            self.pos = t1
        return key_view, value_view


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.n_embd = config.n_embd
        self.head_dim = self.n_embd // self.n_head
        self.c_q = nn.Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd, bias=False)

    def forward(self, x, cos_sin, kv_cache):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)

        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
        Tq = q.size(2)
        Tk = k.size(2)

        enable_gqa = self.n_head != self.n_kv_head
        if kv_cache is None or Tq == Tk:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        elif Tq == 1:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=enable_gqa)
        else:
            attn_mask = torch.zeros((Tq, Tk), dtype=torch.bool, device=q.device)
            prefix_len = Tk - Tq
            if prefix_len > 0:
                attn_mask[:, :prefix_len] = True
            attn_mask[:, prefix_len:] = torch.tril(
                torch.ones((Tq, Tq), dtype=torch.bool, device=q.device)
            )
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)

        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, kv_cache):
        x = x + self.attn(norm(x), cos_sin, kv_cache)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.rotary_seq_len = config.sequence_len * 10
        head_dim = config.n_embd // config.n_head
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _precompute_rotary_embeddings(self, seq_len, head_dim, base=10000):
        channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32)
        inv_freq = 1.0 / (base ** (channel_range / head_dim))
        t = torch.arange(seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        return cos[None, :, None, :], sin[None, :, None, :]

    def reset_kv_cache(self):
        """The cache lives outside the model; nothing to clear here."""
        return None

    def forward(self, idx, targets=None, cache=None):
        B, T = idx.size()
        T0 = 0 if cache is None else cache.get_pos()
        cos_sin = (
            self.cos[:, T0 : T0 + T].to(self.lm_head.weight.dtype),
            self.sin[:, T0 : T0 + T].to(self.lm_head.weight.dtype),
        )
        x = self.transformer.wte(idx)
        x = norm(x)
        for block in self.transformer.h:
            x = block(x, cos_sin, cache)
        x = norm(x)
        softcap = 15
        logits = self.lm_head(x)
        logits = softcap * torch.tanh(logits / softcap)
        return logits


def make_model():
    torch.manual_seed(6606)
    model = GPT(GPTConfig())
    return model.eval()
