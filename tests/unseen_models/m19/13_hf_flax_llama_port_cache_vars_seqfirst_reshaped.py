"""transformers' Flax LLaMA (modeling_flax_llama.py, FlaxLlamaForCausalLMModule) ported to PyTorch module
by module -- the Flax code base, not modeling_llama.py.

model (FlaxLlamaModule: embed_tokens, layers = FlaxLlamaLayerCollection whose blocks are named "0", "1",
"2" (a ModuleDict here), norm) and lm_head.  Dense layers keep the Flax `kernel` (in, out) layout.
FlaxLlamaAttention: q_proj/k_proj/v_proj/o_proj without bias, GQA 4/2 widened with jnp.repeat on the
head axis (repeat_interleave: query head h reads kv head h // 2), FlaxLlamaRotaryEmbedding from
create_sinusoidal_positions (a float64 sin | cos table split at use, rotate_half), causal mask
turned into an additive bias (0 / finfo.min), dot_product_attention_weights (query / sqrt(head_dim)),
einsum with the values.  RMSNorm with `weight`, SwiGLU mlp.
Cache: book-buffers.  Flax keeps `cached_key` / `cached_value` / `cache_index` variables in the
"cache" collection; here each attention owns `cached_key` / `cached_value` buffers and a
`cache_index`.  The port stores them sequence-first, (max_len 64, batch 4, kv, d), for an exporter.
Drive with `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`;
or `model(prompt, start_pos=0)`, `model(tok, start_pos=L)`.  `model(ids)` is the full forward and
touches no cache.  Returns the logits tensor.
The first cached call (cache_index 0) attends over the fresh keys/values directly ("prefill fast path")
and only writes them.
Slip: `_concatenate_to_cache` writes `key.transpose(0, 1)` into the sequence-first buffer correctly but
reads the filled part back with `.reshape(batch, length, kv, d)` instead of `.transpose(0, 1)`, which
interleaves the rows of different sequences and time steps (exact at batch 1, wrong from step 0 at
batch 2).
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
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "model.layers.0.self_attn",
    },
    "style": "modeling_flax_llama.py ported: Dense kernels (in, out), blocks ModuleDict '0'..'2', "
    "create_sinusoidal_positions sin|cos table with rotate_half, GQA 4/2 jnp.repeat, additive 0/finfo.min "
    "bias; cached_key/cached_value kept (len, batch, kv, d) but read back with reshape instead of transpose",
}


class Dense(nn.Module):
    def __init__(self, in_features, features):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(in_features, features) / math.sqrt(in_features))

    def forward(self, x):
        return x @ self.kernel


class FlaxLlamaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.epsilon = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states / torch.sqrt(variance + self.epsilon)
        return self.weight * hidden_states


def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.einsum("i,j->ij", torch.arange(num_pos, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.cat((torch.sin(emb)[:, :, None], torch.cos(emb)[:, :, None]), dim=-1)  # (pos, d, 2)


def rotate_half(tensor):
    return torch.cat((-tensor[..., tensor.shape[-1] // 2 :], tensor[..., : tensor.shape[-1] // 2]), dim=-1)


def apply_rotary_pos_emb(tensor, sin_pos, cos_pos):
    return (tensor * cos_pos) + (rotate_half(tensor) * sin_pos)


class FlaxLlamaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, max_position_embeddings):
        super().__init__()
        self.sincos = create_sinusoidal_positions(max_position_embeddings, head_dim)  # float64

    def forward(self, key, query, position_ids):
        sincos = self.sincos[position_ids].to(key.dtype)  # (b, s, d, 2)
        sin_pos, cos_pos = sincos[..., 0][:, :, None, :], sincos[..., 1][:, :, None, :]
        return apply_rotary_pos_emb(key, sin_pos, cos_pos), apply_rotary_pos_emb(query, sin_pos, cos_pos)


class FlaxLlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = Dense(self.embed_dim, self.num_heads * self.head_dim)
        self.k_proj = Dense(self.embed_dim, self.num_key_value_heads * self.head_dim)
        self.v_proj = Dense(self.embed_dim, self.num_key_value_heads * self.head_dim)
        self.o_proj = Dense(self.embed_dim, self.embed_dim)
        self.rotary_emb = FlaxLlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings)
        shape = (config.max_cache_len, config.max_cache_batch, self.num_key_value_heads, self.head_dim)
        self.register_buffer("cached_key", torch.zeros(shape), persistent=False)
        self.register_buffer("cached_value", torch.zeros(shape), persistent=False)
        self.cache_index = 0

    def _concatenate_to_cache(self, key, value, cur_index):
        batch, num_updated, kv, d = key.shape
        end = cur_index + num_updated
        self.cached_key[cur_index:end, :batch] = key.transpose(0, 1).to(self.cached_key.dtype)
        self.cached_value[cur_index:end, :batch] = value.transpose(0, 1).to(self.cached_value.dtype)
        self.cache_index = end
        if cur_index == 0:
            return key, value
        key = self.cached_key[:end, :batch].reshape(batch, end, kv, d)
        value = self.cached_value[:end, :batch].reshape(batch, end, kv, d)
        return key, value

    def forward(self, hidden_states, attention_bias, position_ids, use_cache=False):
        b, s, _ = hidden_states.shape
        query = self.q_proj(hidden_states).reshape(b, s, self.num_heads, self.head_dim)
        key = self.k_proj(hidden_states).reshape(b, s, self.num_key_value_heads, self.head_dim)
        value = self.v_proj(hidden_states).reshape(b, s, self.num_key_value_heads, self.head_dim)
        key, query = self.rotary_emb(key, query, position_ids)
        if use_cache:
            key, value = self._concatenate_to_cache(key, value, int(position_ids[0, 0]))
        key = torch.repeat_interleave(key, self.num_key_value_groups, dim=2)
        value = torch.repeat_interleave(value, self.num_key_value_groups, dim=2)
        query = query / math.sqrt(self.head_dim)
        attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key) + attention_bias
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.einsum("...hqk,...khd->...qhd", attn_weights, value)
        return self.o_proj(attn_output.reshape(b, s, self.embed_dim))


class FlaxLlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = Dense(config.hidden_size, config.intermediate_size)
        self.down_proj = Dense(config.intermediate_size, config.hidden_size)
        self.up_proj = Dense(config.hidden_size, config.intermediate_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FlaxLlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = FlaxLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = FlaxLlamaAttention(config)
        self.post_attention_layernorm = FlaxLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = FlaxLlamaMLP(config)

    def forward(self, hidden_states, attention_bias, position_ids, use_cache=False):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_bias, position_ids, use_cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class FlaxLlamaModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): FlaxLlamaDecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm = FlaxLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, start_pos=0, use_cache=False):
        b, s = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(start_pos, start_pos + s, device=input_ids.device)[None].expand(b, -1)
        q_pos = torch.arange(start_pos, start_pos + s, device=input_ids.device)
        k_pos = torch.arange(0, start_pos + s, device=input_ids.device)
        dtype = hidden_states.dtype
        allowed = k_pos[None, :] <= q_pos[:, None]
        bias = torch.where(allowed, torch.zeros((), dtype=dtype),
                           torch.tensor(torch.finfo(dtype).min, dtype=dtype))[None, None]
        for block in self.layers.values():
            hidden_states = block(hidden_states, bias, position_ids, use_cache)
        return self.norm(hidden_states)


class FlaxLlamaForCausalLMModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = FlaxLlamaModule(config)
        self.lm_head = Dense(config.hidden_size, config.vocab_size)

    def reset_kv_cache(self):
        for block in self.model.layers.values():
            block.self_attn.cached_key.zero_()
            block.self_attn.cached_value.zero_()
            block.self_attn.cache_index = 0

    def forward(self, input_ids, start_pos=None, use_cache=False):
        if start_pos is not None:
            use_cache = True
            if start_pos == 0:
                self.reset_kv_cache()
        elif use_cache:
            start_pos = self.model.layers["0"].self_attn.cache_index
        else:
            start_pos = 0
        return self.lm_head(self.model(input_ids, start_pos=start_pos, use_cache=use_cache))


def make_model():
    torch.manual_seed(1913)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, max_cache_len=64,
        max_cache_batch=4,
    )
    model = FlaxLlamaForCausalLMModule(config)
    g = torch.Generator().manual_seed(19131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, FlaxLlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
