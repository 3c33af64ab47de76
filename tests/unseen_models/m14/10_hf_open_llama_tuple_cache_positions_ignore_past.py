"""OpenLLaMA architecture from transformers' (deprecated) modeling_open_llama.py, reduced.

OpenLlamaForCausalLM: model (OpenLlamaModel: embed_tokens, layers.N, norm) and lm_head.
OpenLlamaDecoderLayer is pre-norm (input_layernorm, self_attn, post_attention_layernorm, mlp with
gate/down/up, SiLU).  OpenLlamaAttention: q_proj/k_proj/v_proj/o_proj without bias, MHA 4 x 16,
OpenLlamaRotaryEmbedding with cos_cached/sin_cached (halves, base 1e4, float64 then cast) sliced to
kv_seq_len and gathered by position_ids, legacy (k, v) tuple cache (b, h, s, d) concatenated on dim 2,
additive causal mask (finfo.min) of shape (b, 1, q, past + q) from _prepare_decoder_attention_mask.
Cache: hf tuples: `out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`.
Slip: OpenLlamaModel builds `position_ids = torch.arange(seq_length)` (the line that should start at
past_key_values_length lost its offset), so every decoded token is rotated as position 0.  The mask
and the key lengths are right.  Full forward and prompt pass are exact.
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
    "style": "modeling_open_llama.py: cos_cached/sin_cached gathered by position_ids, legacy (k, v) tuples (b, h, s, d), "
    "_prepare_decoder_attention_mask; slip: position_ids = arange(seq_length) without the past length",
}


class OpenLlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class OpenLlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()[None, None]
        self.sin_cached = emb.sin()[None, None]

    def forward(self, x, seq_len):
        return self.cos_cached[:, :, :seq_len].to(x.dtype), self.sin_cached[:, :, :seq_len].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class OpenLlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = OpenLlamaRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


class OpenLlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OpenLlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = OpenLlamaAttention(config)
        self.mlp = OpenLlamaMLP(config)
        self.input_layernorm = OpenLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OpenLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states, present = self.self_attn(self.input_layernorm(hidden_states), attention_mask,
                                                position_ids, past_key_value, use_cache)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


def _prepare_decoder_attention_mask(bsz, tgt_len, past_key_values_length, dtype):
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype).triu(1)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class OpenLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OpenLlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = OpenLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).view(-1, seq_length)
        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = _prepare_decoder_attention_mask(batch_size, seq_length, past_key_values_length,
                                                         inputs_embeds.dtype)
        hidden_states = inputs_embeds
        next_decoder_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, attention_mask, position_ids, past_key_value, use_cache)
            if use_cache:
                next_decoder_cache += (present,)
        return self.norm(hidden_states), next_decoder_cache


class OpenLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = OpenLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(1410)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, rope_theta=10000, rms_norm_eps=1e-6)
    model = OpenLlamaForCausalLM(config)
    g = torch.Generator().manual_seed(14101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, OpenLlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
