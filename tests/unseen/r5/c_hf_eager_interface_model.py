"""Hugging Face "attention interface" style: module-level eager_attention_forward called from the layer; the model builds the causal mask."""

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn


def eager_attention_forward(
    module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs
):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key.shape[-2]]
        attn_weights = attn_weights + causal_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward}


class TinyRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class TinyAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        inner = config.num_attention_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        attention_interface = ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class TinyMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TinyAttention(config, layer_idx)
        self.mlp = TinyMLP(config)
        self.input_layernorm = TinyRMSNorm(config.hidden_size)
        self.post_attention_layernorm = TinyRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


@dataclass
class BaseModelOutput:
    last_hidden_state: torch.Tensor
    hidden_states: tuple | None = None


class TinyModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            [TinyDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = TinyRMSNorm(config.hidden_size)

    def _causal_mask(self, inputs_embeds):
        batch, seq_len = inputs_embeds.shape[:2]
        min_value = torch.finfo(inputs_embeds.dtype).min
        mask = torch.full(
            (seq_len, seq_len), min_value, dtype=inputs_embeds.dtype, device=inputs_embeds.device
        )
        mask = torch.triu(mask, diagonal=1)
        return mask[None, None].expand(batch, 1, seq_len, seq_len)

    def forward(self, inputs_embeds, attention_mask=None):
        causal_mask = self._causal_mask(inputs_embeds) if attention_mask is None else attention_mask
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask)
        return BaseModelOutput(last_hidden_state=self.norm(hidden_states))


def make_model():
    config = SimpleNamespace(
        hidden_size=12,
        num_attention_heads=3,
        intermediate_size=32,
        num_hidden_layers=1,
        attention_dropout=0.0,
        attention_bias=True,
        _attn_implementation="eager",
    )
    return TinyModel(config)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "style": "Hugging Face attention-interface (eager_attention_forward(module, q, k, v, mask, scaling, dropout)), model-built causal mask, dataclass output",
}
