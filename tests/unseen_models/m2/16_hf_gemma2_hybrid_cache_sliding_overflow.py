"""A tiny Gemma 2 in the style of Hugging Face's modeling_gemma2.py with a HybridCache.

Gemma2ForCausalLM -> model (embed_tokens scaled by sqrt(hidden), layers ModuleList, norm,
rotary_emb) + tied lm_head (final_logit_softcapping 30, logits only; no attention
softcapping).  Layers alternate sliding / global starting with sliding (layer 0 and 2 slide,
window 3; layer 1 is global).  GQA 4/2, head_dim 16 with hidden 48, scaling
query_pre_attn_scalar**-0.5 = 1/4, (1 + weight) RMSNorm, sandwich norms, rotate_half rotary.

HybridCache: global layers get a static 64-slot buffer written with index_copy_ at
cache_position; sliding layers get a buffer of sliding_window slots.  A multi-token prefill
keeps the last window of keys and attends with the fresh keys; a one-token step writes its
slot and attends over the buffer with a mask of the filled slots.

Slip: the one-token path of the sliding update writes the new key at slot cache_position
(k_out.narrow(2, pos, 1).copy_(...)) instead of rolling the buffer once it is full.  As soon
as the position reaches the window (3) the write falls off the end of the 3-slot buffer and
raises.  With a prompt of 3 or more tokens that is step 0, inside model.layers.0.self_attn.
The full forward is right.
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
    "decode": {"mistake": "cache_other", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "transformers modeling_gemma2.py + HybridCache (static global buffers, window-sized sliding buffers); "
    "slip: the sliding one-token update writes at slot cache_position without rolling, so it raises once "
    "the position reaches the window",
}


@dataclass
class Gemma2Config:
    vocab_size: int = 128
    hidden_size: int = 48
    intermediate_size: int = 96
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    query_pre_attn_scalar: int = 16
    sliding_window: int = 3
    final_logit_softcapping: float = 30.0
    max_cache_len: int = 64


class HybridCache:
    def __init__(self, config, max_cache_len=64):
        self.config = config
        self.max_cache_len = max_cache_len
        self.sliding_window = config.sliding_window
        self.is_sliding = [not bool(i % 2) for i in range(config.num_hidden_layers)]
        self.key_cache = [None] * config.num_hidden_layers
        self.value_cache = [None] * config.num_hidden_layers
        self._seen_tokens = 0

    def _init_layer(self, layer_idx, key_states):
        B, H, _, D = key_states.shape
        n = self.sliding_window if self.is_sliding[layer_idx] else self.max_cache_len
        self.key_cache[layer_idx] = torch.zeros(B, H, n, D, dtype=key_states.dtype)
        self.value_cache[layer_idx] = torch.zeros(B, H, n, D, dtype=key_states.dtype)

    def _sliding_update(self, cache_position, key_states, value_states, k_out, v_out):
        T = key_states.shape[2]
        W = k_out.shape[2]
        if T > 1:
            keep = min(T, W)
            k_out[:, :, :keep].copy_(key_states[:, :, -keep:].detach())
            v_out[:, :, :keep].copy_(value_states[:, :, -keep:].detach())
            return key_states, value_states
        pos = int(cache_position[0])
        k_out.narrow(2, pos, 1).copy_(key_states.detach())
        v_out.narrow(2, pos, 1).copy_(value_states.detach())
        return k_out, v_out

    def _static_update(self, cache_position, key_states, value_states, k_out, v_out):
        k_out.index_copy_(2, cache_position, key_states.detach())
        v_out.index_copy_(2, cache_position, value_states.detach())
        return k_out, v_out

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if self.key_cache[layer_idx] is None:
            self._init_layer(layer_idx, key_states)
        cache_position = cache_kwargs.get("cache_position")
        if layer_idx == 0:
            self._seen_tokens += key_states.shape[-2]
        k_out, v_out = self.key_cache[layer_idx], self.value_cache[layer_idx]
        if self.is_sliding[layer_idx]:
            return self._sliding_update(cache_position, key_states, value_states, k_out, v_out)
        return self._static_update(cache_position, key_states, value_states, k_out, v_out)

    def get_seq_length(self, layer_idx=0):
        return self._seen_tokens


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[HybridCache] = None


class Gemma2RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float() if x.dtype != torch.float64 else x)
        output = output * (1.0 + self.weight.to(output.dtype))
        return output.type_as(x)


class Gemma2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = (
            self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        )
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
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


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class Gemma2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.is_causal = True
        self.is_sliding = not bool(layer_idx % 2)
        self.sliding_window = config.sliding_window if self.is_sliding else None
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

    def forward(
        self,
        hidden_states,
        position_embeddings,
        attention_mask,
        past_key_values=None,
        cache_position=None,
    ):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            cache_kwargs = {
                "sin": sin,
                "cos": cos,
                "cache_position": cache_position,
                "sliding_window": self.sliding_window,
            }
            key_states, value_states = past_key_values.update(
                key_states, value_states, self.layer_idx, cache_kwargs
            )
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class Gemma2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.is_sliding = not bool(layer_idx % 2)
        self.self_attn = Gemma2Attention(config=config, layer_idx=layer_idx)
        self.mlp = Gemma2MLP(config)
        self.input_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states,
        position_embeddings,
        attention_mask,
        past_key_values=None,
        cache_position=None,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            cache_position=cache_position,
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + hidden_states


def _additive(allowed, dtype):
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[
        None, None
    ]


class Gemma2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Gemma2RotaryEmbedding(config=config)

    def _masks(self, cache_position, q_len, dtype, using_cache):
        q = cache_position[:, None]
        W = self.config.sliding_window
        full_len = self.config.max_cache_len if using_cache else int(cache_position[-1]) + 1
        kv = torch.arange(full_len)[None, :]
        full = _additive(kv <= q, dtype)
        if q_len > 1 or not using_cache:
            kv = torch.arange(int(cache_position[-1]) + 1)[None, :]
            sliding = _additive((kv <= q) & (kv > q - W), dtype)
        else:
            filled = min(int(cache_position[0]) + 1, W)
            sliding = _additive(torch.arange(W)[None, :] < filled, dtype)
        return {"full": full, "sliding": sliding}

    def forward(
        self,
        input_ids,
        past_key_values=None,
        use_cache=False,
        cache_position=None,
        position_ids=None,
    ):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = HybridCache(self.config, max_cache_len=self.config.max_cache_len)
        if cache_position is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(past_seen, past_seen + inputs_embeds.shape[1])
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        masks = self._masks(
            cache_position, inputs_embeds.shape[1], inputs_embeds.dtype, past_key_values is not None
        )

        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=inputs_embeds.dtype)
        hidden_states = inputs_embeds * normalizer
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=masks["sliding" if decoder_layer.is_sliding else "full"],
                past_key_values=past_key_values,
                cache_position=cache_position,
            )
        return self.norm(hidden_states), past_key_values


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Gemma2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids,
        past_key_values=None,
        use_cache=False,
        cache_position=None,
        position_ids=None,
    ):
        hidden_states, past_key_values = self.model(
            input_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            cache_position=cache_position,
            position_ids=position_ids,
        )
        logits = self.lm_head(hidden_states)
        cap = self.config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
        return CausalLMOutputWithPast(
            logits=logits, past_key_values=past_key_values if use_cache else None
        )


def make_model():
    torch.manual_seed(1616)
    model = Gemma2ForCausalLM(Gemma2Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Gemma2RMSNorm):
                m.weight.copy_(0.3 * torch.randn_like(m.weight))
    return model.eval()
