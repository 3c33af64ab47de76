"""Ministral with a sliding-window overlay written as q_idx - kv_idx <= sliding_window:
each query sees 11 keys (itself included) instead of the declared 10.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MinistralConfig:
    hidden_size: int = 96
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 100000000.0
    rms_norm_eps: float = 1e-5
    sliding_window: int = 10
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])


class MinistralRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class MinistralRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(x.dtype) * self.inv_freq[None, None, :].to(x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


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


class MinistralAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = (
            config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        )
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

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class MinistralDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MinistralAttention(config, layer_idx)
        self.input_layernorm = MinistralRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return residual + self.self_attn(hidden_states, position_embeddings, attention_mask)


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return q_idx - kv_idx <= sliding_window

    return inner_mask


def and_masks(*mask_functions):
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = torch.ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result

    return and_mask


def sdpa_mask(batch_size, q_len, kv_len, mask_function):
    q_idx = torch.arange(q_len)[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    mask = mask_function(None, None, q_idx, kv_idx)
    return mask[None, None].expand(batch_size, 1, q_len, kv_len)


class MinistralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([MinistralDecoderLayer(config, 0)])
        self.rotary_emb = MinistralRotaryEmbedding(config)
        self.norm = MinistralRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        position_ids = torch.arange(n).unsqueeze(0).expand(bsz, -1)
        causal_mask_mapping = {
            "full_attention": sdpa_mask(bsz, n, n, causal_mask_function),
            "sliding_attention": sdpa_mask(
                bsz,
                n,
                n,
                and_masks(causal_mask_function, sliding_window_overlay(self.config.sliding_window)),
            ),
        }
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, causal_mask_mapping[layer.attention_type], position_embeddings
            )
        return self.norm(hidden_states)


def make_ministral():
    torch.manual_seed(112)
    model = MinistralModel(MinistralConfig())
    with torch.no_grad():
        model.layers[0].input_layernorm.weight.uniform_(0.5, 1.5)
        model.norm.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_ministral",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "HF Ministral (mask functions and_masks(causal, sliding overlay), sliding_window 10): overlay uses <=, one key too many",
}
