"""Command-R in the shape of transformers' modeling_cohere.py (written from memory, in my own words):
`model.embed_tokens`, `model.layers.N` with a *parallel* block (one `input_layernorm`, then
residual + self_attn(h) + mlp(h)), `CohereLayerNorm` (mean-centred, weight only, no bias),
`CohereRotaryEmbedding` that repeat_interleaves the frequencies and a `rotate_half` that pairs
adjacent elements (x[..., ::2], x[..., 1::2]) -> interleaved pairing, q/k/v/o_proj without bias,
GQA 6 query heads / 2 kv heads (head_dim 16, hidden 96) via repeat_kv, eager attention with an
additive causal mask of finfo.min built from cache_position, SwiGLU gate/up/down, `model.norm`,
tied lm_head and `logit_scale` 0.0625.  3 layers, vocab 160, rope theta 8e6 (any base is fine).

Cache (hf): `out = model(ids, use_cache=True)` creates a `CohereCache` (per-layer key/value lists,
(b, kv, s, d), `update()` concatenates on dim −2, `get_seq_length()` gives the offset);
`model(tok, past_key_values=out.past_key_values, use_cache=True)` continues.  Returns an object
with `.logits` and `.past_key_values`.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 6,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 8000000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "modeling_cohere.py: parallel block with one input_layernorm, bias-free mean-centred CohereLayerNorm, "
    "repeat_interleave rotary (interleaved), GQA 6/2 d 96, finfo.min mask from cache_position, logit_scale, CohereCache",
}


class CohereConfig:
    vocab_size = 160
    hidden_size = 96
    intermediate_size = 160
    num_hidden_layers = 3
    num_attention_heads = 6
    num_key_value_heads = 2
    rope_theta = 8000000.0
    layer_norm_eps = 1e-5
    logit_scale = 0.0625
    max_position_embeddings = 128


class CausalLMOutput:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class CohereCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]

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


class CohereLayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = (
            hidden_states.to(torch.float32) if input_dtype != torch.float64 else hidden_states
        )
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight.to(hidden_states.dtype) * hidden_states
        return hidden_states.to(input_dtype)


class CohereRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq.double()[None, :, None].expand(
            position_ids.shape[0], -1, 1
        )
        position_ids_expanded = position_ids[:, None, :].double()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class CohereMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CohereAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = (
            F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
            if query_states.dtype != torch.float64
            else F.softmax(attn_weights, dim=-1)
        )
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class CohereDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = CohereAttention(config, layer_idx)
        self.mlp = CohereMLP(config)
        self.input_layernorm = CohereLayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_out = self.self_attn(
            hidden_states, position_embeddings, attention_mask, past_key_value
        )
        mlp_out = self.mlp(hidden_states)
        return residual + attn_out + mlp_out


class CohereModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [CohereDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = CohereLayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = CohereRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def _update_causal_mask(self, inputs_embeds, cache_position, target_length):
        dtype = inputs_embeds.dtype
        min_dtype = torch.finfo(dtype).min
        seq_len = inputs_embeds.shape[1]
        causal_mask = torch.full((seq_len, target_length), fill_value=min_dtype, dtype=dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask = causal_mask * (torch.arange(target_length) > cache_position.reshape(-1, 1))
        return causal_mask[None, None, :, :].expand(inputs_embeds.shape[0], 1, -1, -1)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = CohereCache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen, past_seen + inputs_embeds.shape[1])
        position_ids = cache_position.unsqueeze(0)
        causal_mask = self._update_causal_mask(
            inputs_embeds, cache_position, past_seen + inputs_embeds.shape[1]
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings,
                causal_mask,
                past_key_values if use_cache else None,
            )
        return self.norm(hidden_states), past_key_values


class CohereForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = CohereModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.logit_scale = config.logit_scale

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, past = self.model(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        logits = self.lm_head(hidden_states) * self.logit_scale
        return CausalLMOutput(logits, past if use_cache else None)


def make_model():
    torch.manual_seed(6105)
    model = CohereForCausalLM(CohereConfig())
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for m in model.modules():
            if isinstance(m, CohereLayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
