"""Llama 4 text model, NoPE layer (no rotary) with attention temperature tuning.

Layer 3 of an interleaved NoPE schedule: no rotary and no qk norm on this layer. The
temperature tuning multiplies queries by log(floor((pos + 1) / floor_scale) + 1) * attn_scale
+ 1, which is exactly 1 for every position below floor_scale - 1 (8191), so at the token
counts used here the layer is plain scaled dot-product attention. GQA 8:2 handed to SDPA
through repeat_kv, with a boolean causal mask built by the model.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Llama4TextConfig:
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 8
    rms_norm_eps: float = 1e-5
    intermediate_size: int = 128
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    no_rope_layer_interval: int = 4
    no_rope_layers: list = field(default_factory=list)


class Llama4TextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def repeat_kv(hidden_states, n_rep):
    batch, num_kv, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_kv, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_kv * n_rep, slen, head_dim)


class Llama4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attn_scale = config.attn_scale
        self.floor_scale = config.floor_scale
        self.attn_temperature_tuning = config.attn_temperature_tuning
        # no_rope_layers[i] == 0 marks a NoPE layer
        self.use_rope = bool(config.no_rope_layers[layer_idx])
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

    def forward(self, hidden_states, attention_mask, cache_position):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if self.attn_temperature_tuning and not self.use_rope:
            attn_scales = (
                torch.log(
                    torch.floor((cache_position.to(query_states.dtype) + 1.0) / self.floor_scale)
                    + 1.0
                )
                * self.attn_scale
                + 1.0
            )
            attn_scales = attn_scales.view((1, input_shape[-1], 1, 1)).expand((*input_shape, 1, 1))
            query_states = query_states * attn_scales

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class Llama4TextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Llama4TextAttention(config, layer_idx)
        self.input_layernorm = Llama4TextRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, cache_position):
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        return residual + self.self_attn(h, attention_mask, cache_position)


class Llama4NoPEStack(nn.Module):
    """Layers 0..3 of the schedule; only layer 3 is built here (the NoPE one)."""

    def __init__(self, config):
        super().__init__()
        config.no_rope_layers = [
            int((i + 1) % config.no_rope_layer_interval != 0)
            for i in range(config.no_rope_layer_interval)
        ]
        self.layers = nn.ModuleDict({"3": Llama4TextDecoderLayer(config, 3)})

    def forward(self, inputs_embeds):
        n = inputs_embeds.shape[1]
        cache_position = torch.arange(n)
        causal = cache_position[None, :] <= cache_position[:, None]
        mask = causal[None, None, :, :].expand(inputs_embeds.shape[0], 1, n, n)
        return self.layers["3"](inputs_embeds, mask, cache_position)


def make_llama4_nope():
    torch.manual_seed(102)
    stack = Llama4NoPEStack(Llama4TextConfig())
    with torch.no_grad():
        stack.layers["3"].input_layernorm.weight.uniform_(0.5, 1.5)
    return stack.eval()


EXPECT = {
    "target": "make_llama4_nope",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.3.self_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Llama 4 NoPE layer (no_rope_layers schedule, interval 4): attention temperature tuning (factor 1 "
    "below position 8191), GQA 8:2 repeat_kv into SDPA with a boolean causal mask from the model",
}
