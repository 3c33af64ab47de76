"""Emu3 text tower, after transformers' modeling_emu3.py (Emu3ForCausalLM text path).

Emu3ForCausalLM: model (Emu3TextModel: embed_tokens, layers.N = Emu3DecoderLayer, norm, rotary_emb)
and lm_head.  Emu3DecoderLayer: input_layernorm -> self_attn -> dropout -> + residual ->
post_attention_layernorm -> mlp (SwiGLU) -> + residual.  Emu3Attention: q/k/v/o bias-free, GQA 4/2
(repeat_kv), rotate_half rotary base 1e6 (inv_freq in float64), eager matmul attention with an additive
finfo.min causal mask built from cache_position.
Cache: hf with a cache object (`Emu3Cache`: update(k, v, layer_idx) concatenating on dim 2,
get_seq_length()).  `out = model(ids, use_cache=True)`; `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`.  Correct.
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
    "style": "modeling_emu3.py text tower: Emu3TextModel/Emu3DecoderLayer, GQA 4/2 repeat_kv, rotate_half base 1e6, "
    "Emu3Cache object, finfo.min mask from cache_position",
}


class Emu3Cache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class Emu3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class Emu3RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids[:, :, None].double() * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Emu3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype) if q.dtype != torch.float64 \
            else F.softmax(attn_weights, dim=-1)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class Emu3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Emu3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Emu3Attention(config, layer_idx)
        self.mlp = Emu3MLP(config)
        self.input_layernorm = Emu3RMSNorm(config.hidden_size)
        self.post_attention_layernorm = Emu3RMSNorm(config.hidden_size)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                       past_key_value)
        hidden_states = residual + self.dropout(hidden_states)
        residual = hidden_states
        return residual + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))


class Emu3TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Emu3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Emu3RMSNorm(config.hidden_size)
        self.rotary_emb = Emu3RotaryEmbedding(config.hidden_size // config.num_attention_heads, config.rope_theta)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = Emu3Cache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        q_len = inputs_embeds.shape[1]
        cache_position = torch.arange(past_seen, past_seen + q_len, device=inputs_embeds.device)
        position_ids = cache_position.unsqueeze(0)
        kv_positions = torch.arange(past_seen + q_len, device=inputs_embeds.device)
        min_val = torch.finfo(inputs_embeds.dtype).min
        causal_mask = torch.where(kv_positions[None, :] > cache_position[:, None],
                                  torch.tensor(min_val, dtype=inputs_embeds.dtype),
                                  torch.tensor(0.0, dtype=inputs_embeds.dtype))[None, None]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, causal_mask, past_key_values)
        return self.norm(hidden_states), past_key_values


class Emu3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Emu3TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1301)
    config = SimpleNamespace(vocab_size=98, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6)
    model = Emu3ForCausalLM(config)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Emu3RMSNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()
