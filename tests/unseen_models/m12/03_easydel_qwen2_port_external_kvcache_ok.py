"""EasyDeL's Qwen2 (easydel/modules/qwen2) ported from Flax to torch, keeping its module tree.

Qwen2ForCausalLM: `model` (Qwen2Model: embed_tokens, layers.N, norm) and lm_head.  Qwen2Attention keeps
EasyDeL's names: q_proj/k_proj/v_proj with bias, o_proj without, GQA 4/2; EasyDeL's
`_merge_heads`/`_split_heads` helpers, rotary applied by a `rotary` module built per layer with
`is_neox_style=True` (halves), base 1e6, and attention computed by an `AttentionModule` helper that
takes (b, s, h, d) tensors and an additive bias built from a boolean causal matrix (0 / finfo.min).
Cache: book-cache: an external `KVCache(n_layers=3)` object passed as `cache=`: `get(i)`,
`update(i, (k, v))`, `seq_len()`; keys/values held (b, s, kv, d) and grown on dim 1.
`model(ids)` without a cache is the full forward.  Returns the logits tensor.  Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "EasyDeL Qwen2 port: q/k/v bias, GQA 4/2, neox-style rotary module base 1e6, (b, s, h, d) "
    "AttentionModule with 0/finfo.min bias, external KVCache(n_layers) with (b, s, kv, d) entries",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, i):
        return self.cache[i]

    def update(self, i, kv):
        self.cache[i] = kv

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def reset(self):
        self.cache = [None] * len(self.cache)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.kernel = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.kernel


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, base, is_neox_style=True):
        super().__init__()
        self.head_size, self.base, self.is_neox_style = head_size, base, is_neox_style

    def forward(self, positions, x):
        half = self.head_size // 2
        inv = 1.0 / self.base ** (torch.arange(half, dtype=x.dtype) * 2 / self.head_size)
        f = positions.to(x.dtype)[..., None] * inv
        cos, sin = f.cos()[:, :, None], f.sin()[:, :, None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class AttentionModule(nn.Module):
    def forward(self, query_states, key_states, value_states, bias, softmax_scale):
        w = torch.einsum("bqhd,bkhd->bhqk", query_states, key_states) * softmax_scale + bias
        w = F.softmax(w, dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", w, value_states)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        self.idx = idx
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rope_theta)
        self.attention_performer = AttentionModule()

    def _split_heads(self, x, n):
        return x.reshape(x.shape[0], x.shape[1], n, self.head_dim)

    def _merge_heads(self, x):
        return x.reshape(x.shape[0], x.shape[1], -1)

    def forward(self, hidden_states, positions, bias, cache=None):
        q = self._split_heads(self.q_proj(hidden_states), self.num_heads)
        k = self._split_heads(self.k_proj(hidden_states), self.num_kv)
        v = self._split_heads(self.v_proj(hidden_states), self.num_kv)
        q = self.rotary(positions, q)
        k = self.rotary(positions, k)
        if cache is not None:
            prev = cache.get(self.idx)
            if prev is not None:
                k = torch.cat([prev[0], k], dim=1)
                v = torch.cat([prev[1], v], dim=1)
            cache.update(self.idx, (k, v))
        rep = self.num_heads // self.num_kv
        k = torch.repeat_interleave(k, rep, dim=2)
        v = torch.repeat_interleave(v, rep, dim=2)
        out = self.attention_performer(q, k, v, bias, self.head_dim ** -0.5)
        return self.o_proj(self._merge_heads(out))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        self.self_attn = Qwen2Attention(cfg, idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h, positions, bias, cache):
        h = h + self.self_attn(self.input_layernorm(h), positions, bias, cache)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size)

    def forward(self, input_ids, cache=None):
        b, n = input_ids.shape
        start = cache.seq_len() if cache is not None else 0
        h = self.embed_tokens(input_ids)
        positions = torch.arange(start, start + n)[None].expand(b, n)
        causal = torch.arange(start + n)[None, :] <= positions[0][:, None]
        bias = torch.zeros(causal.shape, dtype=h.dtype).masked_fill(~causal, torch.finfo(h.dtype).min)[None, None]
        for layer in self.layers:
            h = layer(h, positions, bias, cache)
        return self.norm(h)


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        return self.lm_head(self.model(input_ids, cache=cache))


class Qwen2Config:
    vocab_size = 100
    hidden_size = 64
    intermediate_size = 160
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 1000000.0


def make_model():
    torch.manual_seed(1203)
    model = Qwen2ForCausalLM(Qwen2Config())
    g = torch.Generator().manual_seed(12031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.kernel.copy_(1.0 + 0.3 * torch.randn(m.kernel.shape, generator=g))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.2, generator=g)
    return model.eval()
