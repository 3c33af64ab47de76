"""Llama as MLC-LLM writes it (python/mlc_llm/model/llama/llama_model.py, TVM Relax nn), ported to torch,
with a small torch stand-in for MLC's PagedKVCache.

LlamaForCausalLM: model (LlamaModel: embed_tokens, layers.N = LlamaDecoderLayer {input_layernorm,
self_attn, post_attention_layernorm, mlp (gate_up_proj fused, down_proj)}, norm), lm_head.
LlamaAttention: fused `qkv_proj` reshaped to (b, s, h_q + 2 * h_kv, d) and handed to
`paged_kv_cache.attention_with_fused_qkv(layer_id, qkv, num_qo_heads, sm_scale=head_dim ** -0.5)`, then
`o_proj`.  As in MLC, the cache op does the rest: it splits q/k/v, applies the rotary embedding at the
sequence's positions (rope_mode NORMAL: rotate_half halves, theta 1e4), appends k/v to the sequence's
pages (page_size 2, each page (b, kv, 2, d)), and attends causally; GQA 4/2 (query head h reads kv head
h // 2).
Cache: book-cache: `cache = mod.KVCache(n_layers=3)`, `model.reset_kv_cache()` (no-op: a new KVCache
is the reset), `model(prompt, cache=cache)`, `model(tok, cache=cache)`.  `model(ids)` builds a
throw-away cache, so the full pass goes through the same op.
Slip: the decode branch of the op (one new token) walks the page table starting from the sequence's
*last* page (`page_indptr` read one entry too late): a decoded token attends only to the keys on its
own page.  Prefill is exact.  With page_size 2 the first decoded token already misses keys for any prompt
of 2 or more tokens.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "MLC-LLM Llama port: fused qkv_proj handed to PagedKVCache.attention_with_fused_qkv (rope inside the cache op, "
    "pages of 2), gate_up_proj; slip: one-token decode reads only the last page, so it cannot see earlier cached keys",
}


class KVCache:
    """Stand-in for MLC's PagedKVCache (one sequence per batch row, all rows the same length)."""

    def __init__(self, n_layers, page_size=2, rope_theta=10000.0):
        self.n_layers = n_layers
        self.page_size = page_size
        self.rope_theta = rope_theta
        self.pages = [[] for _ in range(n_layers)]
        self.lengths = [0 for _ in range(n_layers)]

    def _rope(self, x, positions):
        d = x.shape[-1]
        inv = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
        ang = torch.outer(positions.to(torch.float64), inv)
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def _append(self, layer_id, k, v):
        pages = self.pages[layer_id]
        ps = self.page_size
        for t in range(k.shape[2]):
            slot = self.lengths[layer_id] % ps
            if slot == 0:
                b, kv, _, d = k.shape
                pages.append((k.new_zeros(b, kv, ps, d), v.new_zeros(b, kv, ps, d)))
            pk, pv = pages[-1]
            pk = pk.clone()
            pv = pv.clone()
            pk[:, :, slot] = k[:, :, t]
            pv[:, :, slot] = v[:, :, t]
            pages[-1] = (pk, pv)
            self.lengths[layer_id] += 1

    def _gather(self, layer_id, first_page):
        pages = self.pages[layer_id][first_page:]
        k = torch.cat([p[0] for p in pages], dim=2)
        v = torch.cat([p[1] for p in pages], dim=2)
        n = self.lengths[layer_id] - first_page * self.page_size
        return k[:, :, :n], v[:, :, :n]

    def attention_with_fused_qkv(self, layer_id, qkv, num_qo_heads, sm_scale):
        b, s, h_total, d = qkv.shape
        num_kv_heads = (h_total - num_qo_heads) // 2
        q, k, v = torch.split(qkv, [num_qo_heads, num_kv_heads, num_kv_heads], dim=2)
        q, k, v = [x.transpose(1, 2) for x in (q, k, v)]
        start = self.lengths[layer_id]
        positions = torch.arange(start, start + s, device=qkv.device)
        q = self._rope(q, positions)
        k = self._rope(k, positions)
        self._append(layer_id, k, v)
        if s == 1:
            first_page = (self.lengths[layer_id] - 1) // self.page_size
        else:
            first_page = 0
        keys, values = self._gather(layer_id, first_page)
        key_pos = torch.arange(first_page * self.page_size, self.lengths[layer_id], device=qkv.device)
        rep = num_qo_heads // num_kv_heads
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * sm_scale
        visible = key_pos[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).transpose(1, 2)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_q_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, paged_kv_cache, layer_id):
        d, h_q, h_kv = self.head_dim, self.num_q_heads, self.num_kv_heads
        b, s, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).reshape(b, s, h_q + h_kv + h_kv, d)
        output = paged_kv_cache.attention_with_fused_qkv(layer_id, qkv, self.num_q_heads, sm_scale=self.head_dim ** -0.5)
        return self.o_proj(output.reshape(b, s, h_q * d))


class LlamaFFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        x1, x2 = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(x1) * x2)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaFFN(config)
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)

    def forward(self, hidden_states, paged_kv_cache, layer_id):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), paged_kv_cache, layer_id)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size)

    def forward(self, input_ids, paged_kv_cache):
        hidden_states = self.embed_tokens(input_ids)
        for layer_id, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, paged_kv_cache, layer_id)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        if cache is None:
            cache = KVCache(self.config.num_hidden_layers)
        return self.lm_head(self.model(input_ids, cache))


def make_model():
    torch.manual_seed(1512)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(15121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
