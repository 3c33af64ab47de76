"""Petals' LLaMA (bigscience-workshop/petals src/petals/models/llama/block.py + model.py), a server block
whose Bloom-to-LLaMA cache reorder lost its permute.

`DistributedLlamaForCausalLM`: `model` (embed_tokens, `layers` - the RemoteSequential, here a ModuleList
of server-side `WrappedLlamaBlock`s -, norm) and `lm_head`.  WrappedLlamaBlock subclasses
OptimizedLlamaDecoderLayer (`self_attn` = OptimizedLlamaAttention, q/k/v/o_proj, rotate_half rotary
1e4 by `position_ids`, `repeat_kv`, additive finfo.min mask, float32 softmax; GQA 4/2; 2 layers) and keeps
the cache in Petals' Bloom wire format: keys (b * kv, head_dim, s), values (b * kv, s, head_dim).
Cache: hf (`out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`; a tuple of per-layer (keys, values) in Bloom layout).
Slip: `_reorder_cache_from_bloom_to_llama` reshapes the (b * kv, head_dim, s) keys straight to
(b, kv, s, head_dim) without the `permute(0, 2, 1)` first, so the cached keys come back with their
feature and time axes scrambled (no error: the element counts agree).  The values and the writing
side are right; the prompt pass and the full forward are exact.  With a one-token prompt the cached
keys are (d, 1) and survive the reshape, so the first divergence is step 1 there; from prompts of 2
tokens on it is step 0.
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
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "Petals llama block.py: WrappedLlamaBlock(OptimizedLlamaDecoderLayer) with the Bloom-format cache "
    "(keys (b*kv, d, s), values (b*kv, s, d)) reordered around each call, GQA 4/2; slip: the bloom-to-llama "
    "reorder reshapes the keys without permuting (d, s) back (prompts >= 2)",
}


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class OptimizedLlamaAttention(nn.Module):
    def __init__(self, config, values_tiled=False):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.rope_theta)
        self.values_tiled = values_tiled

    def _optimized_apply_rotary(self, query_states, key_states, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (query_states * cos) + (rotate_half(query_states) * sin)
        k_embed = (key_states * cos) + (rotate_half(key_states) * sin)
        return q_embed, k_embed

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = self._optimized_apply_rotary(query_states, key_states, cos, sin)

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        if self.values_tiled:
            value_states = value_states.repeat(1, self.num_key_value_groups, 1, 1)
        else:
            value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OptimizedLlamaDecoderLayer(nn.Module):
    def __init__(self, config, values_tiled=False):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = OptimizedLlamaAttention(config, values_tiled)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, present_key_value = self.self_attn(
            hidden_states, attention_mask, position_ids, past_key_value, use_cache
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states, present_key_value


def _prepare_4d_causal_attention_mask(batch_size, seq_length, dtype, device, past_key_values_length):
    total = seq_length + past_key_values_length
    q_pos = torch.arange(past_key_values_length, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = torch.zeros(seq_length, total, dtype=dtype, device=device)
    mask = mask.masked_fill(k_pos > q_pos, torch.finfo(dtype).min)
    return mask[None, None].expand(batch_size, 1, seq_length, total)


class WrappedLlamaBlock(OptimizedLlamaDecoderLayer):
    def forward(self, hidden_states, *args, attention_mask=None, layer_past=None, use_cache=False, **kwargs):
        batch_size, seq_length, _ = hidden_states.shape
        seq_length_with_past = seq_length
        past_key_values_length = 0
        past_key_value = layer_past
        if past_key_value is not None:
            past_key_values_length = past_key_value[0].shape[2]
            seq_length_with_past = seq_length_with_past + past_key_values_length
            past_key_value = self._reorder_cache_from_bloom_to_llama(
                past_key_value, batch_size, past_key_values_length
            )
        position_ids = torch.arange(
            past_key_values_length, seq_length_with_past, dtype=torch.long, device=hidden_states.device
        ).unsqueeze(0).expand(batch_size, -1)
        attention_mask = _prepare_4d_causal_attention_mask(
            batch_size, seq_length, hidden_states.dtype, hidden_states.device, past_key_values_length
        )
        outputs, present_key_value = super().forward(
            hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, use_cache=use_cache,
        )
        if use_cache:
            present_key_value = self._reorder_cache_from_llama_to_bloom(
                present_key_value, batch_size, seq_length_with_past
            )
        return outputs, present_key_value

    def _reorder_cache_from_bloom_to_llama(self, key_value, batch_size, seq_length):
        key_states, value_states = key_value
        key_states = key_states.reshape(
            batch_size, self.self_attn.num_key_value_heads, seq_length, self.self_attn.head_dim
        )
        value_states = value_states.view(*key_states.shape)
        return (key_states, value_states)

    def _reorder_cache_from_llama_to_bloom(self, key_value, batch_size, seq_length):
        key_states, value_states = key_value
        value_states = value_states.reshape(
            batch_size * self.self_attn.num_key_value_heads, seq_length, self.self_attn.head_dim
        )
        key_states = key_states.reshape(*value_states.shape)
        key_states = key_states.permute(0, 2, 1)
        return (key_states, value_states)


class DistributedLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [WrappedLlamaBlock(config, values_tiled=(i in config.tiled_value_layers))
             for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states = self.embed_tokens(input_ids)
        presents = ()
        for i, block in enumerate(self.layers):
            layer_past = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = block(hidden_states, layer_past=layer_past, use_cache=use_cache)
            presents += (present,)
        return self.norm(hidden_states), (presents if use_cache else None)


class DistributedLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = DistributedLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, presents = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden_states), past_key_values=presents)


def make_model():
    torch.manual_seed(2313)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tiled_value_layers=(),
    )
    model = DistributedLlamaForCausalLM(config)
    g = torch.Generator().manual_seed(23131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
