"""TensorRT-LLM PyTorch-backend Qwen3 (tensorrt_llm/_torch/models/modeling_qwen3.py) without its kernels.

Qwen3ForCausalLM: model (Qwen3Model: embed_tokens, layers.N = Qwen3DecoderLayer with input_layernorm,
self_attn, post_attention_layernorm, mlp (gate_up_proj fused, down_proj)), norm) and lm_head.
Qwen3Attention keeps TRT-LLM's fused `qkv_proj` (split by q_size / kv_size), `o_proj`, per-head
`q_norm`/`k_norm` RMSNorm applied before rotary (`apply_qk_norm`), rotate-half (neox) rotary base 1e6,
GQA 4/2, with the attention backend's work done in torch (explicit matmul * 1/sqrt(d), -inf mask built
from absolute positions).
Cache: book-cache: an external `KVCache(n_layers=3)` (a stand-in for the KVCacheManager) passed as
`cache=`: `get(i)`, `update(i, (k, v))`, `seq_len()`; entries (b, kv, s, d) grown on dim 2.
`model(ids)` without a cache is the full forward.  Returns the logits tensor.
Slip (decode only): in TRT-LLM the generation phase fuses QK norm and rope into one kernel
(`fuse_qk_norm_rope`); the port's generation branch (one token on a non-empty cache) calls the rope
only, so the decoded token's key is written to the cache, and attended to, without `k_norm`.  The
context (prefill) phase and the full forward are exact.
"""

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
    "decode": {"mistake": "cache_other", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "TensorRT-LLM _torch Qwen3: fused qkv_proj/gate_up_proj, per-head q_norm/k_norm before neox rope "
    "base 1e6, GQA 4/2, external KVCache(n_layers); the generation-phase branch writes keys without k_norm",
}


class KVCache:
    def __init__(self, n_layers):
        self.layers = [None] * n_layers

    def get(self, i):
        return self.layers[i]

    def update(self, i, kv):
        self.layers[i] = kv

    def seq_len(self):
        return 0 if self.layers[0] is None else self.layers[0][0].shape[2]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, rope_theta, is_neox=True):
        super().__init__()
        self.head_dim, self.rope_theta, self.is_neox = head_dim, rope_theta, is_neox

    def forward(self, position_ids, x):
        inv = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        f = position_ids.to(torch.float64)[:, None] * inv
        cos, sin = f.cos().to(x.dtype), f.sin().to(x.dtype)
        h = self.head_dim // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Qwen3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_key_value_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)

    def apply_qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)

    def forward(self, hidden_states, position_ids, cache=None):
        b, n, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        prev = cache.get(self.layer_idx) if cache is not None else None
        is_generation = prev is not None and n == 1
        if is_generation:
            # stands in for the fused qk-norm + rope generation kernel
            q = self.rotary_emb(position_ids, self.q_norm(q))
            k = self.rotary_emb(position_ids, k)
        else:
            q, k = self.apply_qk_norm(q, k)
            q = self.rotary_emb(position_ids, q)
            k = self.rotary_emb(position_ids, k)
        if cache is not None:
            if prev is not None:
                k = torch.cat([prev[0], k], dim=2)
                v = torch.cat([prev[1], v], dim=2)
            cache.update(self.layer_idx, (k, v))
        rep = self.num_heads // self.num_key_value_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / self.head_dim ** 0.5)
        key_pos = torch.arange(k.shape[2])
        scores = scores.masked_fill(key_pos[None, :] > position_ids[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, n, self.q_size)
        return self.o_proj(out)


class Qwen3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = Qwen3MLP(config)

    def forward(self, hidden_states, position_ids, cache):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size)

    def forward(self, input_ids, cache=None):
        start = cache.seq_len() if cache is not None else 0
        position_ids = torch.arange(start, start + input_ids.shape[1])
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, position_ids, cache)
        return self.norm(h)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        return self.lm_head(self.model(input_ids, cache=cache))


def make_model():
    torch.manual_seed(1213)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0)
    model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(12131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
