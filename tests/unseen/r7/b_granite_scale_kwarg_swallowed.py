"""Granite-style model body (multi-query: 4 heads, 1 kv head, rotary, attention_multiplier = 1/sqrt(head_dim),
residual/embedding multipliers); bug: after a refactor the layer passes its multiplier as `scale=` while the
shared eager_attention_forward takes `scaling=` (default 1.0) and swallows unknown kwargs, so no scale is applied."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GraniteConfig:
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    attention_dropout: float = 0.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0


class GraniteRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class GraniteRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        self.register_buffer(
            "inv_freq",
            1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = (
            self.inv_freq[None, :, None] @ position_ids[:, None, :].to(self.inv_freq.dtype)
        ).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    """(first half, second half) -> (-second half, first half)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """cos/sin come as (b, s, d); a head axis is inserted at unsqueeze_dim before they broadcast."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(t):
        return t * cos + rotate_half(t) * sin

    return rot(q), rot(k)


def repeat_kv(hidden_states, n_rep):
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d): kv head g serves query heads g * n_rep ... g * n_rep + n_rep - 1."""
    if n_rep == 1:
        return hidden_states
    b, kv_heads, s, d = hidden_states.shape
    return hidden_states.unsqueeze(2).expand(b, kv_heads, n_rep, s, d).flatten(1, 2)


def eager_attention_forward(
    module, query, key, value, attention_mask, scaling=1.0, dropout=0.0, **kwargs
):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class GraniteAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.attention_multiplier
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.k_proj = nn.Linear(
            config.hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.v_proj = nn.Linear(
            config.hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
        )

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scale=self.scaling,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class GraniteMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GraniteAttention(config=config, layer_idx=layer_idx)
        self.mlp = GraniteMLP(config)
        self.input_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states = residual + hidden_states * self.residual_multiplier
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states * self.residual_multiplier


class GraniteModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding_multiplier = config.embedding_multiplier
        self.layers = nn.ModuleList(
            [GraniteDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GraniteRotaryEmbedding(config=config)

    def forward(self, inputs_embeds):
        inputs_embeds = inputs_embeds * self.embedding_multiplier
        bsz, seq_len = inputs_embeds.shape[:2]
        cache_position = torch.arange(seq_len, device=inputs_embeds.device)
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        causal_mask = torch.full(
            (seq_len, seq_len), torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype
        )
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings
            )
        return self.norm(hidden_states)


def make_tiny_granite():
    config = GraniteConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=10000000.0,
        attention_multiplier=0.25,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
    )
    return GraniteModel(config)


EXPECT = {
    "target": "make_tiny_granite",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "layer": "layers.0.self_attn",
    "style": "HF GraniteModel/GraniteAttention (self.scaling = config.attention_multiplier = 0.25, embedding/residual multipliers, MQA repeat_kv); eager_attention_forward called with scale= instead of scaling=, the 1.0 default is used",
}
