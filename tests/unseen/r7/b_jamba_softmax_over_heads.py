"""Jamba-style hybrid stack (a simplified Mamba layer, then a GQA 8:4 attention layer without positions); bug: the
eager attention's softmax runs over dim=1 of (b, heads, q, k), normalizing across heads instead of keys."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class JambaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def repeat_kv(hidden_states, n_rep):
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d): kv head g serves query heads g * n_rep ... g * n_rep + n_rep - 1."""
    if n_rep == 1:
        return hidden_states
    b, kv_heads, s, d = hidden_states.shape
    return hidden_states.unsqueeze(2).expand(b, kv_heads, n_rep, s, d).flatten(1, 2)


class JambaAttention(nn.Module):
    """Plain causal GQA attention: Jamba relies on its Mamba layers for position information."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = True
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        key_states = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        value_states = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=1)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), attn_weights


class JambaMambaMixer(nn.Module):
    """A much reduced selective-scan mixer: causal depthwise conv, input-dependent decay, gated output."""

    def __init__(self, config, layer_idx):
        super().__init__()
        d_inner = config.mamba_expand * config.hidden_size
        self.conv_kernel_size = config.mamba_d_conv
        self.in_proj = nn.Linear(config.hidden_size, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(
            d_inner, d_inner, config.mamba_d_conv, groups=d_inner, padding=config.mamba_d_conv - 1
        )
        self.dt_proj = nn.Linear(d_inner, d_inner)
        self.out_proj = nn.Linear(d_inner, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        seq_len = hidden_states.shape[1]
        x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)
        x = self.conv1d(x.transpose(1, 2))[..., :seq_len].transpose(1, 2)
        x = F.silu(x)
        decay = torch.sigmoid(self.dt_proj(x))
        state = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(seq_len):
            state = decay[:, t] * state + (1 - decay[:, t]) * x[:, t]
            outs.append(state)
        y = torch.stack(outs, dim=1)
        return self.out_proj(y * F.silu(gate))


class JambaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class JambaAttentionDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = JambaAttention(config, layer_idx)
        self.feed_forward = JambaMLP(config)
        self.input_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.feed_forward(self.pre_ff_layernorm(hidden_states))


class JambaMambaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.mamba = JambaMambaMixer(config, layer_idx)
        self.feed_forward = JambaMLP(config)
        self.input_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.mamba(self.input_layernorm(hidden_states))
        return hidden_states + self.feed_forward(self.pre_ff_layernorm(hidden_states))


class JambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        layers = []
        for i in range(config.num_hidden_layers):
            is_attn = i % config.attn_layer_period == config.attn_layer_offset
            layers.append(
                JambaAttentionDecoderLayer(config, i)
                if is_attn
                else JambaMambaDecoderLayer(config, i)
            )
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        dtype = inputs_embeds.dtype
        causal_mask = torch.full(
            (seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=inputs_embeds.device
        )
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=causal_mask)
        return self.final_layernorm(hidden_states)


def make_jamba():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=128,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_expand=2,
        mamba_d_conv=4,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
    )
    return JambaModel(config)


EXPECT = {
    "target": "make_jamba",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "layer": "layers.1.self_attn",
    "style": "HF Jamba hybrid (Mamba mixer layer then JambaAttentionDecoderLayer, repeat_kv, additive finfo.min causal mask); F.softmax(attn_weights, dim=1)",
}
