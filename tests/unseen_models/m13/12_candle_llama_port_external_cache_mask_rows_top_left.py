"""huggingface/candle candle-transformers models/llama.rs, ported to torch line by line.

Llama { wte, blocks: Vec<Block>, ln_f, lm_head }; Block { rms_1, attn: CausalSelfAttention, rms_2, mlp }
(pre-norm, SwiGLU with c_fc1/c_fc2/c_proj); CausalSelfAttention { q_proj, k_proj, v_proj, o_proj } with
GQA 4/2 (candle's utils::repeat_kv, i.e. each kv head repeated n_rep times in a row), rope on halves
(candle_nn::rotary_emb::rope) with cos/sin held by the cache (base 1e4, computed in float64), scores
/ sqrt(head_dim), masked_fill with -inf from `cache.mask(t)` (a (t, t) upper-triangular u8 mask,
memoised in `cache.masks`), softmax, o_proj.
Cache: book-cache.  `cache = mod.KVCache(n_layers=3)` (`get(i)`, `update(i, (k, v))`, `seq_len()`;
also holds `masks`, `cos`, `sin` like candle's `Cache`), `model(prompt, cache=cache)`,
`model(tok, cache=cache)`; entries (b, kv, s, d) grown on dim 2.  `model.reset_kv_cache()` is a no-op.
Returns the logits of every position.
Slip: candle skips the mask when seq_len == 1; the port always masks and, to cover the cached keys,
takes `cache.mask(kv_len)` and keeps its first `seq_len` rows (top-left alignment).  With kv_len ==
seq_len (full forward, prompt) this is exact; a decoded token gets row 0 and sees only the first key.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "blocks.0.attn"},
    "style": "candle llama.rs ported: wte/blocks/ln_f, rms_1/attn/rms_2/mlp, Cache with memoised masks and cos/sin, "
    "GQA 4/2; decode uses the first rows of cache.mask(kv_len) (top-left)",
}

MAX_POS = 64


class KVCache:
    """candle's `Cache`: kvs per block, memoised masks, cos/sin tables."""

    def __init__(self, n_layers, head_dim=16, theta=10000.0):
        self.kvs = [None] * n_layers
        self.masks = {}
        theta_v = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        idx_theta = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * theta_v[None, :]
        self.cos, self.sin = idx_theta.cos(), idx_theta.sin()

    def get(self, i):
        return self.kvs[i]

    def update(self, i, kv):
        self.kvs[i] = kv

    def seq_len(self):
        return 0 if self.kvs[0] is None else self.kvs[0][0].shape[2]

    def mask(self, t):
        if t not in self.masks:
            self.masks[t] = torch.triu(torch.ones(t, t, dtype=torch.uint8), diagonal=1)
        return self.masks[t]


def rope(x, cos, sin):
    # x: (b, h, t, d), cos/sin: (t, d/2) -- candle_nn::rotary_emb::rope (halves)
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2], x[..., d2:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def repeat_kv(xs, n_rep):
    b, n_kv, s, d = xs.shape
    return torch.cat([xs] * n_rep, dim=2).reshape(b, n_kv * n_rep, s, d)


class RmsNorm(nn.Module):
    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden=64, num_attention_heads=4, num_key_value_heads=2):
        super().__init__()
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.head_dim = hidden // num_attention_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, index_pos, block_idx, cache, cos, sin, fresh_mask):
        b_sz, seq_len, hidden = x.shape
        q = self.q_proj(x).reshape(b_sz, seq_len, self.num_attention_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(b_sz, seq_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(b_sz, seq_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos_t, sin_t = cos[index_pos:index_pos + seq_len], sin[index_pos:index_pos + seq_len]
        q = rope(q, cos_t, sin_t)
        k = rope(k, cos_t, sin_t)
        if cache is not None:
            prev = cache.get(block_idx)
            if prev is not None:
                k = torch.cat([prev[0], k], dim=2)
                v = torch.cat([prev[1], v], dim=2)
            cache.update(block_idx, (k, v))
        n_rep = self.num_attention_heads // self.num_key_value_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        kv_len = k.shape[2]
        mask = (cache.mask(kv_len) if cache is not None else fresh_mask(kv_len))[:seq_len]
        att = att.masked_fill(mask.bool().to(att.device), float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b_sz, seq_len, hidden)
        return self.o_proj(y)


class Mlp(nn.Module):
    def __init__(self, hidden=64, inter=128):
        super().__init__()
        self.c_fc1 = nn.Linear(hidden, inter, bias=False)
        self.c_fc2 = nn.Linear(hidden, inter, bias=False)
        self.c_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.rms_1 = RmsNorm(64)
        self.attn = CausalSelfAttention()
        self.rms_2 = RmsNorm(64)
        self.mlp = Mlp()

    def forward(self, x, index_pos, block_idx, cache, cos, sin, fresh_mask):
        x = x + self.attn(self.rms_1(x), index_pos, block_idx, cache, cos, sin, fresh_mask)
        return x + self.mlp(self.rms_2(x))


class Llama(nn.Module):
    def __init__(self, vocab=96):
        super().__init__()
        self.wte = nn.Embedding(vocab, 64)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.ln_f = RmsNorm(64)
        self.lm_head = nn.Linear(64, vocab, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, x, cache=None):
        index_pos = cache.seq_len() if cache is not None else 0
        tables = cache if cache is not None else KVCache(len(self.blocks))
        fresh = KVCache(1)
        h = self.wte(x)
        for block_idx, block in enumerate(self.blocks):
            h = block(h, index_pos, block_idx, cache, tables.cos, tables.sin, fresh.mask)
        return self.lm_head(self.ln_f(h))


def make_model():
    torch.manual_seed(1312)
    model = Llama()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RmsNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()
