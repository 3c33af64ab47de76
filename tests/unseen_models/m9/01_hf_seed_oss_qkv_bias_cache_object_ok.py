"""ByteDance Seed-OSS decoder in the style of transformers' modeling_seed_oss.py (small, random weights).

SeedOssForCausalLM: model (SeedOssModel: embed_tokens, layers.N, norm, rotary_emb) and lm_head.
SeedOssDecoderLayer: input_layernorm -> self_attn -> residual, post_attention_layernorm -> mlp
(gate/up/down, SiLU).  SeedOssAttention: q/k/v projections with bias (attention_bias True), o_proj
without (attention_out_bias False), GQA 4 query heads / 2 kv heads expanded by `repeat_kv`,
rotate_half rotary (halves) from an `inv_freq` buffer, base 1e7, eager matmul * scaling, additive
finfo.min causal mask built from `cache_position`, softmax upcast to at least float32.
Cache: hf, a `SeedOssCache` object (per-layer lists in (b, kv, s, d); `update(k, v, layer_idx)`,
`get_seq_length()`), created when `use_cache=True` and none is given.  Correct everywhere.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {"heads": 4, "kv_heads": 2, "head_dim": 16, "causal": True, "cross": False,
                  "rope": {"pairing": "halves", "fraction": 1.0, "base": 1e7},
                  "qk_norm": None, "window": None, "bias": None},
    "style": "modeling_seed_oss.py: q/k/v bias, o without, GQA 4/2 repeat_kv, rotate_half base 1e7 from inv_freq, "
    "eager finfo.min mask from cache_position, SeedOssCache object",
}


class SeedOssCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class SeedOssRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class SeedOssRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].to(x.dtype).expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].to(x.dtype)
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class SeedOssAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(query_states.dtype, torch.float32)).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class SeedOssMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SeedOssDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SeedOssAttention(config, layer_idx)
        self.mlp = SeedOssMLP(config)
        self.input_layernorm = SeedOssRMSNorm(config.hidden_size)
        self.post_attention_layernorm = SeedOssRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_embeddings, past_key_value=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class SeedOssModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([SeedOssDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = SeedOssRMSNorm(config.hidden_size)
        self.rotary_emb = SeedOssRotaryEmbedding(config)

    def forward(self, input_ids, past_key_values=None, use_cache=False, cache_position=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = SeedOssCache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        if cache_position is None:
            cache_position = torch.arange(past_seen, past_seen + input_ids.shape[1], device=input_ids.device)
        position_ids = cache_position.unsqueeze(0).expand(input_ids.shape[0], -1)
        dtype = inputs_embeds.dtype
        target_length = past_seen + input_ids.shape[1]
        key_pos = torch.arange(target_length, device=input_ids.device)
        blocked = key_pos[None, :] > cache_position[:, None]
        causal_mask = torch.zeros(blocked.shape, dtype=dtype, device=input_ids.device)
        causal_mask = causal_mask.masked_fill(blocked, torch.finfo(dtype).min)[None, None]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_embeddings, past_key_values)
        return self.norm(hidden_states), past_key_values


class SeedOssForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = SeedOssModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False, cache_position=None):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache,
                                   cache_position=cache_position)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(901)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e7)
    model = SeedOssForCausalLM(config)
    g = torch.Generator().manual_seed(9011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SeedOssRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            if isinstance(m, SeedOssAttention):
                for p in (m.q_proj.bias, m.k_proj.bias, m.v_proj.bias):
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()
