"""transformers modeling_mllama.py, the text model alone (MllamaForCausalLM, Llama 3.2 Vision's language
tower with no cross-attention layers in this reduced config).

MllamaForCausalLM: `model` (MllamaTextModel: embed_tokens (vocab + 8 image-token rows), layers.N,
norm, rotary_emb) and lm_head.  MllamaSelfAttentionDecoderLayer: input_layernorm, self_attn,
post_attention_layernorm, mlp (gate/up/down SiLU).  MllamaTextSelfAttention: q/k/v/o without bias, GQA
4/2 (head 16) repeat_kv, rotate_half rotary with llama3 frequency scaling (factor 8, low/high freq
factors 1 / 4, original_max_position_embeddings 16, base 5e5; computed in float64), eager matmul with
the additive finfo.min mask built from `cache_position`, float32 softmax.
Cache: hf with a cache object: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; `MllamaTextCache.update(k, v, layer_idx)`
grows (b, kv, s, d) entries on dim -2; logits in `out.logits`.
Slip: when no `position_ids` are given, the text model derives them the way
`prepare_inputs_for_generation` does, `attention_mask.long().cumsum(-1) - 1`, from an `attention_mask`
that it defaults to ones over the tokens of *this call*.  On a one-token step the new token is rotated at
position 0.  `cache_position` (and so the mask and the cache) use the real past length.  The full forward
and the prompt pass are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "model.layers.0.self_attn",
    },
    "style": "modeling_mllama.py MllamaForCausalLM text tower: vocab + 8 embedding rows, llama3-scaled rotate_half rope "
    "(base 5e5), GQA 4/2 repeat_kv, mask from cache_position, cache object update(); slip: position_ids from the "
    "cumsum of a default attention_mask covering only the current call's tokens",
}


class MllamaTextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32) if input_dtype != torch.float64 else hidden_states
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)


def _compute_llama3_parameters(config):
    base = config.rope_theta
    dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = config.rope_scaling
    factor, low_freq_factor, high_freq_factor = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_context_len = rs["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class MllamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.register_buffer("inv_freq", _compute_llama3_parameters(config), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq.double()[None, None, :]
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
    return hidden_states[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class MllamaTextCache:
    def __init__(self):
        self.layers = []

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.layers) <= layer_idx else self.layers[layer_idx][0].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.layers) <= layer_idx:
            self.layers.append((key_states, value_states))
        else:
            k, v = self.layers[layer_idx]
            self.layers[layer_idx] = (torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2))
        return self.layers[layer_idx]


class MllamaTextSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_embeddings, past_key_values=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        sm_dtype = torch.float64 if query_states.dtype == torch.float64 else torch.float32
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=sm_dtype).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(bsz, q_len, -1))


class MllamaTextMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MllamaSelfAttentionDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MllamaTextSelfAttention(config, layer_idx)
        self.mlp = MllamaTextMLP(config)
        self.input_layernorm = MllamaTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MllamaTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings, past_key_values=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_embeddings, past_key_values)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class MllamaTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size + 8, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [MllamaSelfAttentionDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = MllamaTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MllamaRotaryEmbedding(config)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        inputs_embeds = self.embed_tokens(input_ids)
        bsz, seq_len = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = MllamaTextCache()
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + seq_len, device=inputs_embeds.device)
        if attention_mask is None:
            attention_mask = torch.ones(bsz, seq_len, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        dtype = inputs_embeds.dtype
        kv_len = past_seen_tokens + seq_len
        allowed = torch.arange(kv_len, device=input_ids.device)[None, :] <= cache_position[:, None]
        causal_mask = torch.zeros(seq_len, kv_len, dtype=dtype, device=input_ids.device)
        causal_mask = causal_mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_embeddings, past_key_values)
        return self.norm(hidden_states), past_key_values


class MllamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MllamaTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False, attention_mask=None, position_ids=None):
        hidden_states, cache = self.model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache,
        )
        return SimpleNamespace(logits=self.lm_head(hidden_states), past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1810)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        pad_token_id=0, cross_attention_layers=[],
    )
    model = MllamaForCausalLM(config)
    g = torch.Generator().manual_seed(18101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MllamaTextRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
