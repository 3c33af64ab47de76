"""OLMo-1 (transformers modeling_olmo.py) with its own cache class.

model.embed_tokens, model.layers.N (input_layernorm, self_attn, post_attention_layernorm, mlp
gate/up/down SwiGLU), model.norm, lm_head.  OlmoLayerNorm is non-parametric (F.layer_norm with no
weight or bias: there are no norm gains to set).  OlmoAttention: q/k/v/o without bias, optional
clip_qkv (None here), rotate_half rotary (base 10000) from position_ids, causal mask right-aligned
to the keys the layer holds, eager softmax in the input dtype.  OlmoCache: per-layer key/value
lists (b, h, s, d), a seen-token counter advanced by layer 0 in update(), get_seq_length().
Slip: update() stores a layer's entry only when it has none; later calls return the concatenation
without storing it, so the cache keeps the prompt only.
hf: model(ids, use_cache=True), then model(tok, past_key_values=out.past_key_values, use_cache=True).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "model.layers.0.self_attn"},
    "style": "modeling_olmo.py (OLMo-1): non-parametric OlmoLayerNorm, q/k/v/o without bias, clip_qkv hook, rotate_half "
    "rotary, OlmoCache with a seen-token counter; slip: update() stores only a layer's first entry",
}


class OlmoConfig:
    vocab_size = 100
    hidden_size = 64
    intermediate_size = 176
    num_hidden_layers = 3
    num_attention_heads = 4
    rope_theta = 10000.0
    clip_qkv = None
    max_position_embeddings = 64


class OlmoCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []
        self._seen_tokens = 0

    def update(self, key_states, value_states, layer_idx):
        if layer_idx == 0:
            self._seen_tokens += key_states.shape[-2]
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
            return key_states, value_states
        return (
            torch.cat([self.key_cache[layer_idx], key_states], dim=-2),
            torch.cat([self.value_cache[layer_idx], value_states], dim=-2),
        )

    def get_seq_length(self, layer_idx=0):
        return self._seen_tokens


class OlmoLayerNorm(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.normalized_shape = (hidden_size,)

    def forward(self, hidden_states):
        return F.layer_norm(hidden_states, self.normalized_shape, None, None, eps=1e-5)


class OlmoRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(self.inv_freq.dtype) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class OlmoAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        if self.config.clip_qkv is not None:
            query_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            key_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            value_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )
        kv_len = key_states.shape[-2]
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / (self.head_dim**0.5)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=hidden_states.device).tril(
            kv_len - q_len
        )
        attn_weights = attn_weights.masked_fill(~allowed, torch.finfo(attn_weights.dtype).min)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), None


class OlmoMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OlmoDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = OlmoAttention(config, layer_idx)
        self.mlp = OlmoMLP(config)
        self.input_layernorm = OlmoLayerNorm(config.hidden_size)
        self.post_attention_layernorm = OlmoLayerNorm(config.hidden_size)

    def forward(self, hidden_states, position_embeddings, past_key_value=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, past_key_value
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class OlmoModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [OlmoDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = OlmoLayerNorm(config.hidden_size)
        self.rotary_emb = OlmoRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = OlmoCache()
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        bsz, T = input_ids.shape
        cache_position = torch.arange(
            past_seen_tokens, past_seen_tokens + T, device=input_ids.device
        )
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        hidden_states = self.embed_tokens(input_ids)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, position_embeddings, past_key_values if use_cache else None
            )
        return self.norm(hidden_states), (past_key_values if use_cache else None)


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[OlmoCache] = None


class OlmoForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = OlmoModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(712)
    model = OlmoForCausalLM(OlmoConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.1)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)
    return model.eval()
