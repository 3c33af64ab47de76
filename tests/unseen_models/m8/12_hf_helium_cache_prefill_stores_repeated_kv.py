"""Kyutai Helium causal LM, after transformers' modeling_helium.py.

HeliumForCausalLM: model.embed_tokens, model.layers.N (HeliumDecoderLayer: input_layernorm, self_attn,
post_attention_layernorm, mlp gate/up/down), model.norm, lm_head.  HeliumRMSNorm computes in float32
(or float64) and multiplies by (weight) in the input dtype.  HeliumAttention: q_proj/k_proj/v_proj/
o_proj without bias, GQA 4/2, Helium's interleaved rotary (rotate_half on even/odd lanes; cos/sin built
as cat(freqs, freqs) and narrowed to the first half, then repeat_interleave(2)), base 1e5, scaling
1/sqrt(head_dim), additive causal mask (finfo.min) as wide as the keys held.
Cache: hf.  `out = model(ids, use_cache=True)` creates a HeliumCache (the Cache-like class in this file:
per-layer lists, update(k, v, layer_idx), get_seq_length()), then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`.
Slip: the attention has two paths.  The filling path (no cache, or an empty one: the full forward and
every prompt, whatever its length) repeats the kv heads to the query heads *before* calling
cache.update, so the cache stores 4 heads per layer; the path for a cache that already holds tokens
updates it with the 2 kv heads and repeats afterwards.  The first decoding step concatenates
(b, 4, P, 16) with (b, 2, 1, 16) and raises RuntimeError in layer 0.
"""

from types import SimpleNamespace
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "modeling_helium.py: interleaved rotary (repeat_interleave cos/sin, even/odd rotate_half) base 1e5, GQA 4/2, "
    "HeliumCache class; slip: the cache-filling path caches repeat_kv-expanded keys/values, the "
    "decoding path appends unexpanded ones, so step 0 raises in torch.cat",
}


class HeliumCache:
    def __init__(self):
        self.key_cache: List[torch.Tensor] = []
        self.value_cache: List[torch.Tensor] = []

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]


class HeliumRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hs = hidden_states if input_dtype == torch.float64 else hidden_states.to(torch.float32)
        variance = hs.pow(2).mean(-1, keepdim=True)
        hs = hs * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.to(hs.dtype) * hs).to(input_dtype)


class HeliumRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None]
        freqs = (inv @ position_ids[:, None, :].to(inv.dtype)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class HeliumAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = 1 / (self.head_dim**0.5)
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        filling = past_key_value is None or past_key_value.get_seq_length(self.layer_idx) == 0
        if filling:
            key_states = repeat_kv(key_states, self.num_key_value_groups)
            value_states = repeat_kv(value_states, self.num_key_value_groups)
            if past_key_value is not None:
                key_states, value_states = past_key_value.update(
                    key_states, value_states, self.layer_idx
                )
        else:
            if past_key_value is not None:
                key_states, value_states = past_key_value.update(
                    key_states, value_states, self.layer_idx
                )
            key_states = repeat_kv(key_states, self.num_key_value_groups)
            value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = (
            torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(*input_shape, -1)
        )
        return self.o_proj(attn_output), attn_weights


class HeliumMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeliumDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = HeliumAttention(config, layer_idx)
        self.mlp = HeliumMLP(config)
        self.input_layernorm = HeliumRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = HeliumRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings, past_key_value):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class HeliumModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [HeliumDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = HeliumRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = HeliumRotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = HeliumCache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        seq_len = inputs_embeds.shape[1]
        cache_position = torch.arange(past_seen, past_seen + seq_len, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        total = past_seen + seq_len
        dtype = inputs_embeds.dtype
        blocked = torch.arange(total, device=input_ids.device)[None, :] > cache_position[:, None]
        mask = torch.zeros(seq_len, total, dtype=dtype, device=input_ids.device).masked_fill(
            blocked, torch.finfo(dtype).min
        )[None, None]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings, past_key_values)
        return self.norm(hidden_states), past_key_values


class HeliumForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = HeliumModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(
            logits=self.lm_head(hidden), past_key_values=cache if use_cache else None
        )


def make_model():
    torch.manual_seed(812)
    config = SimpleNamespace(
        vocab_size=190,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-8,
        rope_theta=100000.0,
    )
    model = HeliumForCausalLM(config)
    g = torch.Generator().manual_seed(8121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, HeliumRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
