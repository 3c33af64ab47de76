"""intel-analytics/ipex-llm's optimized Llama forward (ipex_llm/transformers/models/llama.py + kv.py) in plain torch.

After ipex-llm's `merge_qkv` the attention holds one `qkv_proj` Linear (q, k, v rows stacked) and
`o_proj`; the forward views it as (b, s, heads + 2 * kv_heads, d), transposes and splits it into
[heads, kv, kv].  Rotary is Llama's rotate_half (theta 1e4) from a `rotary_emb` module (the
xe_addons fused kernel is the same arithmetic).  GQA 6 query heads over 2 kv heads, head_dim 8
(hidden 48).  The cache object is ipex-llm's `DynamicNormalCache`: per layer a preallocated storage
(KV_CACHE_ALLOC_BLOCK_LENGTH extra slots, grown by `extend_kv_cache`) and a narrowed view of the
filled part; `update(key, value, layer_idx)` appends in place (`append_kv_cache`) and returns the
views.  Attention: matmul, / sqrt(d), additive causal mask (finfo.min), softmax in float32 style.
Cache: hf: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "ipex-llm llama: merge_qkv'd qkv_proj viewed (b, s, h+2kv, d) and split [h, kv, kv], GQA 6/2 "
    "head_dim 8, rotate_half 1e4, DynamicNormalCache with preallocated storage (init/append/extend_kv_cache), "
    "finfo.min additive mask",
}

KV_CACHE_ALLOC_BLOCK_LENGTH = 4


def init_kv_cache(bsz, num_heads, head_dim, current_length, max_length, dtype, device):
    key_storage = torch.zeros(bsz, num_heads, max_length, head_dim, dtype=dtype, device=device)
    value_storage = torch.zeros(bsz, num_heads, max_length, head_dim, dtype=dtype, device=device)
    return key_storage, value_storage


def extend_kv_cache(bsz, num_heads, head_dim, current_length, max_length, dtype, device, old_k, old_v):
    new_k, new_v = init_kv_cache(bsz, num_heads, head_dim, current_length, max_length, dtype, device)
    new_k[:, :, :current_length] = old_k[:, :, :current_length]
    new_v[:, :, :current_length] = old_v[:, :, :current_length]
    return new_k, new_v


def append_kv_cache(key_storage, value_storage, cur_len, key_states, value_states):
    new_len = cur_len + key_states.size(2)
    key_storage[:, :, cur_len:new_len] = key_states
    value_storage[:, :, cur_len:new_len] = value_states
    return key_storage[:, :, :new_len], value_storage[:, :, :new_len]


class DynamicNormalCache:
    def __init__(self):
        self.key_storage = []
        self.value_storage = []
        self.key_cache = []
        self.value_cache = []
        self._seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].size(2)

    def update(self, key_states, value_states, layer_idx):
        bsz, num_heads, seq_len, head_dim = key_states.shape
        if layer_idx == 0:
            self._seen_tokens += seq_len
        if len(self.key_cache) <= layer_idx:
            k_st, v_st = init_kv_cache(
                bsz, num_heads, head_dim, 0, seq_len + KV_CACHE_ALLOC_BLOCK_LENGTH,
                key_states.dtype, key_states.device,
            )
            k, v = append_kv_cache(k_st, v_st, 0, key_states, value_states)
            self.key_storage.append(k_st)
            self.value_storage.append(v_st)
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            cur_len = self.key_cache[layer_idx].size(2)
            k_st, v_st = self.key_storage[layer_idx], self.value_storage[layer_idx]
            if cur_len + seq_len > k_st.size(2):
                k_st, v_st = extend_kv_cache(
                    bsz, num_heads, head_dim, cur_len,
                    cur_len + seq_len + KV_CACHE_ALLOC_BLOCK_LENGTH,
                    key_states.dtype, key_states.device, k_st, v_st,
                )
                self.key_storage[layer_idx], self.value_storage[layer_idx] = k_st, v_st
            k, v = append_kv_cache(k_st, v_st, cur_len, key_states, value_states)
            self.key_cache[layer_idx], self.value_cache[layer_idx] = k, v
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(b, kv, n_rep, s, d)
    return hidden_states.reshape(b, kv * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        qkv = self.qkv_proj(hidden_states)
        qkv = qkv.view(bsz, q_len, self.num_heads + 2 * self.num_key_value_heads, self.head_dim)
        qkv = qkv.transpose(1, 2)
        query_states, key_states, value_states = qkv.split(
            [self.num_heads, self.num_key_value_heads, self.num_key_value_heads], dim=1
        )
        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32 if attn_weights.dtype != torch.float64 else None)
        attn_weights = attn_weights.to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), past_key_value


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = DynamicNormalCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        hidden_states = self.embed_tokens(input_ids)
        dtype = hidden_states.dtype
        position_ids = torch.arange(past_len, past_len + seq_len, device=input_ids.device)[None].expand(bsz, -1)
        mask = torch.full((seq_len, past_len + seq_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        mask = torch.triu(mask, diagonal=past_len + 1)[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_ids, past_key_values if use_cache else None)
        return self.norm(hidden_states), (past_key_values if use_cache else None)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(2203)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=48, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(22031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
