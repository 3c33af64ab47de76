"""google/tunix Llama 3 model (Flax NNX) ported to PyTorch, kept close to its module tree.

Llama3: `embedder` (Embedder with `input_embedding`), `layers.N` (DecoderLayer: `input_layernorm`,
`attn`, `post_attention_layernorm`, `mlp`), `final_norm`, `lm_head`.  Attention holds `q_proj`,
`k_proj`, `v_proj` as Einsum modules with kernels laid out (embed, heads, head_dim) and `o_proj`
with (heads, head_dim, embed), applied with torch.einsum as NNX does.  GQA 4/2 (head 16) by reshaping
the queries into (b, t, kv, group, d) groups, rotary by halves (split in two, as tunix's apply_rope)
with base 5e5, positions = cache end index + arange, causal mask from segment positions, finfo.min
fill, softmax in float32 for float32 inputs.  Cache: an external `KVCache(n_layers)` whose entries are
(b, s, kv, d) tensors grown on dim 1 (tunix keeps `k`, `v`, `end_index` per layer).
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "google/tunix llama3 (NNX) ported: Einsum kernels (embed, heads, head_dim), grouped einsum GQA 4/2, "
    "split-halves rotary base 5e5 at end_index + arange, external KVCache (b, s, kv, d) grown on dim 1",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


class Einsum(nn.Module):
    def __init__(self, eqn, shape, fan_in):
        super().__init__()
        self.eqn = eqn
        self.kernel = nn.Parameter(torch.randn(*shape) / math.sqrt(fan_in))

    def forward(self, x):
        return torch.einsum(self.eqn, x, self.kernel)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.w


def apply_rope(x, positions, head_dim, base):
    # x (b, t, h, d); positions (t,)
    frac = 2.0 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim
    timescale = base**frac
    angles = positions.to(torch.float64)[:, None] / timescale[None, :]
    sin = torch.sin(angles)[None, :, None, :].to(x.dtype)
    cos = torch.cos(angles)[None, :, None, :].to(x.dtype)
    first, second = torch.split(x, head_dim // 2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.q_proj = Einsum("btd,dnh->btnh", (cfg.embed_dim, cfg.num_heads, cfg.head_dim), cfg.embed_dim)
        self.k_proj = Einsum("btd,dnh->btnh", (cfg.embed_dim, cfg.num_kv_heads, cfg.head_dim), cfg.embed_dim)
        self.v_proj = Einsum("btd,dnh->btnh", (cfg.embed_dim, cfg.num_kv_heads, cfg.head_dim), cfg.embed_dim)
        self.o_proj = Einsum("btnh,nhd->btd", (cfg.num_heads, cfg.head_dim, cfg.embed_dim), cfg.num_heads * cfg.head_dim)
        self.scale = self.head_dim**-0.5

    def forward(self, x, segment_pos, layer_cache):
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x), segment_pos, self.head_dim, self.rope_theta)
        k = apply_rope(self.k_proj(x), segment_pos, self.head_dim, self.rope_theta)
        v = self.v_proj(x)
        if layer_cache is not None:
            k = torch.cat([layer_cache[0], k], dim=1)
            v = torch.cat([layer_cache[1], v], dim=1)
        new_cache = (k, v)
        s = k.shape[1]
        g = self.num_heads // self.num_kv_heads
        qg = q.reshape(b, t, self.num_kv_heads, g, self.head_dim)
        logits = torch.einsum("btkgh,bskh->bkgts", qg, k) * self.scale
        key_pos = torch.arange(s, device=x.device)
        allowed = key_pos[None, :] <= segment_pos[:, None]
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
        probs = F.softmax(logits.float(), dim=-1).to(v.dtype)
        enc = torch.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, self.num_heads, self.head_dim)
        return self.o_proj(enc), new_cache


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.embed_dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.embed_dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.embed_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, segment_pos, layer_cache):
        a, new_cache = self.attn(self.input_layernorm(x), segment_pos, layer_cache)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), new_cache


class Embedder(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.input_embedding = nn.Parameter(torch.randn(vocab, dim))

    def encode(self, ids):
        return self.input_embedding[ids]


class Llama3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embedder = Embedder(cfg.vocab_size, cfg.embed_dim)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.embed_dim, cfg.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        t = input_ids.shape[1]
        end_index = cache.seq_len() if cache is not None else 0
        segment_pos = end_index + torch.arange(t, device=input_ids.device)
        x = self.embedder.encode(input_ids)
        for i, layer in enumerate(self.layers):
            x, new_cache = layer(x, segment_pos, cache.get(i) if cache is not None else None)
            if cache is not None:
                cache.update(i, new_cache)
        return self.lm_head(self.final_norm(x))


def make_model():
    torch.manual_seed(2001)
    cfg = SimpleNamespace(vocab_size=96, embed_dim=64, hidden_dim=128, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=500000.0, norm_eps=1e-5)
    model = Llama3(cfg)
    g = torch.Generator().manual_seed(20011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.w.copy_(1.0 + 0.3 * torch.randn(m.w.shape, generator=g))
    return model.eval()
