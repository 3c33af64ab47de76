"""jax-ml/jax-llm-examples qwen3_jax (model.py) ported to torch modules, functional style kept.

Qwen3: `embedding`, `layers.N` (Layer: `attn_pre_norm`, `attn`, `attn_post_norm`, `w_gate`/`w_up`/`w_down`
einsum weights), `final_norm`, `lm_head` (d, vocab) weight.  The attention weights live in
`layers.N.attn` (AttentionLayer) as einsum kernels `q` (d, heads, hd), `k` / `v` (d, kv, hd), `o`
(heads, hd, d), with per-head RMS `q_norm` / `k_norm` (gamma) before the rotary.  Rotary: halves
(`apply_rotary_embedding` with sin/cos from `generate_pos_embeddings`, base 1e6, float64 cast at use)
at positions `cache.iter + arange(t)`.  `attention()`: queries grouped (b, kv, g, t, d) against keys
(b, kv, s, d) (head h uses kv head h // g), scale hd**-0.5, `make_attention_mask(q_len, k_len, q_offset)`
with `q_positions = arange(q_len) + q_offset >= k_positions`, where(mask, qk, -1e30), float32 softmax.
GQA 4/2, head 16.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)` (`get(i)`, `update(i, (k, v))`, `seq_len()`, `iter`),
`model(prompt, cache=cache)`, `model(tok, cache=cache)`; entries (b, kv, s, d) grown on dim 2;
`model.reset_kv_cache()` is a no-op.  Returns the logits tensor (every position).
Slip: the decode branch (a call that finds keys in the cache) calls `make_attention_mask` without
`q_offset` (the prefill branch has no offset to pass, and the argument was dropped when the two were
merged), so the new token's query is placed at position 0 of the mask: it sees only the first cached key.
The rotary positions use `cache.iter` and are right.  The prompt pass and the full forward are exact.
"""

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "layers.0.attn",
        "layers.1.attn",
        "layers.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {
        "mistake": "cache_mask",
        "step": 0,
        "layer": "layers.0.attn",
    },
    "style": "jax-llm-examples qwen3_jax port: einsum kernels q (d, h, hd) / k / v / o (h, hd, d), per-head q_norm/k_norm "
    "gamma before halves rope at cache.iter + t (base 1e6), grouped (b, kv, g, t, d) attention, where(mask, qk, -1e30); "
    "external KVCache; slip: the decode branch builds the mask with q_offset dropped (query at position 0)",
}


class KVCache:
    def __init__(self, n_layers):
        self.k = [None] * n_layers
        self.v = [None] * n_layers

    @property
    def iter(self):
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def seq_len(self):
        return self.iter

    def get(self, layer_idx):
        if self.k[layer_idx] is None:
            return None
        return self.k[layer_idx], self.v[layer_idx]

    def update(self, layer_idx, kv):
        k, v = kv
        if self.k[layer_idx] is None:
            self.k[layer_idx], self.v[layer_idx] = k, v
        else:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=2)
        return self.k[layer_idx], self.v[layer_idx]

    def reset(self):
        self.k = [None] * len(self.k)
        self.v = [None] * len(self.v)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float() if x.dtype != torch.float64 else x
        rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.gamma * (xf / rms)).to(x.dtype)


def generate_pos_embeddings(positions, features, rope_theta, dtype):
    fraction = torch.arange(0, features, 2, dtype=torch.float64) / features
    timescale = rope_theta**fraction
    rotational_frequency = 1.0 / timescale
    sinusoid_inp = positions.double()[..., None] * rotational_frequency[None, None, :]
    return torch.sin(sinusoid_inp).to(dtype), torch.cos(sinusoid_inp).to(dtype)


def apply_rotary_embedding(x, sin, cos):
    # x (b, h, t, d); sin/cos (b, t, d/2)
    x1, x2 = x.chunk(2, dim=-1)
    sin, cos = sin[:, None], cos[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def make_attention_mask(q_len, k_len, q_offset=None, device=None):
    q_positions = torch.arange(q_len, device=device)[:, None]
    if q_offset is not None:
        q_positions = q_positions + q_offset
    k_positions = torch.arange(k_len, device=device)[None, :]
    return q_positions >= k_positions


def attention(q, k, v, mask):
    # q (b, h, t, d) -> (b, kv, g, t, d); k, v (b, kv, s, d)
    b, h, t, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, kv, h // kv, t, d)
    scale = d**-0.5
    qk = torch.einsum("bhgtd,bhsd->bhgts", q, k) * scale
    qk = torch.where(mask[None, None, None], qk, torch.tensor(-1e30, dtype=qk.dtype))
    sm_dtype = torch.float64 if qk.dtype == torch.float64 else torch.float32
    scores = torch.softmax(qk.to(sm_dtype), dim=-1).to(v.dtype)
    out = torch.einsum("bhgts,bhsd->bhgtd", scores, v)
    return out.reshape(b, h, t, d)


class AttentionLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, h, kv, hd = cfg.embed, cfg.q_heads, cfg.kv_heads, cfg.head_dim
        self.q = nn.Parameter(torch.randn(d, h, hd) / d**0.5)
        self.k = nn.Parameter(torch.randn(d, kv, hd) / d**0.5)
        self.v = nn.Parameter(torch.randn(d, kv, hd) / d**0.5)
        self.o = nn.Parameter(torch.randn(h, hd, d) / (h * hd) ** 0.5)
        self.q_norm = RMSNorm(hd)
        self.k_norm = RMSNorm(hd)

    def forward(self, x, positions, cache, idx):
        q = torch.einsum("btd,dhq->bhtq", x, self.q)
        k = torch.einsum("btd,dhq->bhtq", x, self.k)
        v = torch.einsum("btd,dhq->bhtq", x, self.v)
        q, k = self.q_norm(q), self.k_norm(k)
        sin, cos = generate_pos_embeddings(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        q = apply_rotary_embedding(q, sin, cos)
        k = apply_rotary_embedding(k, sin, cos)
        t = x.shape[1]
        if cache is not None and cache.get(idx) is not None:
            k, v = cache.update(idx, (k, v))
            mask = make_attention_mask(t, k.shape[2], device=x.device)
        else:
            if cache is not None:
                cache.update(idx, (k, v))
            mask = make_attention_mask(t, k.shape[2], q_offset=0, device=x.device)
        out = attention(q, k, v, mask)
        return torch.einsum("bhtq,hqd->btd", out, self.o)


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg.embed, cfg.mlp_ffw_size
        self.attn_pre_norm = RMSNorm(d)
        self.attn = AttentionLayer(cfg)
        self.attn_post_norm = RMSNorm(d)
        self.w_gate = nn.Parameter(torch.randn(d, f) / d**0.5)
        self.w_up = nn.Parameter(torch.randn(d, f) / d**0.5)
        self.w_down = nn.Parameter(torch.randn(f, d) / f**0.5)

    def forward(self, x, positions, cache, idx):
        x = x + self.attn(self.attn_pre_norm(x), positions, cache, idx)
        h = self.attn_post_norm(x)
        ff = torch.nn.functional.silu(h @ self.w_gate) * (h @ self.w_up)
        return x + ff @ self.w_down


class Qwen3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.embed)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed)
        self.lm_head = nn.Parameter(torch.randn(cfg.embed, cfg.vocab_size) / cfg.embed**0.5)

    def reset_kv_cache(self):
        pass

    def forward(self, tokens, cache=None):
        b, t = tokens.shape
        start = cache.iter if cache is not None else 0
        positions = (start + torch.arange(t, device=tokens.device))[None].expand(b, t)
        x = self.embedding(tokens)
        for idx, layer in enumerate(self.layers):
            x = layer(x, positions, cache, idx)
        return self.final_norm(x) @ self.lm_head


class Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def make_model():
    torch.manual_seed(1812)
    cfg = Config(
        vocab_size=96, embed=64, q_heads=4, kv_heads=2, head_dim=16, num_layers=3,
        mlp_ffw_size=128, rope_theta=1000000.0,
    )
    model = Qwen3(cfg)
    g = torch.Generator().manual_seed(18121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.gamma.copy_(1.0 + 0.3 * torch.randn(m.gamma.shape, generator=g))
    return model.eval()
