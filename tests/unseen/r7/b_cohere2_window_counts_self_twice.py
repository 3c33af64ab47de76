"""Cohere2 (Command R7B)-style model with one sliding layer (parallel attention + MLP block, interleaved rotary on
sliding layers, GQA 4:2, config.sliding_window=4); bug: the model's window mask subtracts the query itself twice,
keeping i - j < sliding_window - 1, so a query sees 3 keys instead of 4."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class Cohere2LayerNorm(nn.Module):
    """Mean-centred LayerNorm with a weight and no bias."""

    def __init__(self, hidden_size=None, eps=1e-5, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Cohere2RotaryEmbedding(nn.Module):
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
        freqs = position_ids[:, :, None].to(self.inv_freq.dtype) * self.inv_freq[None, None, :]
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


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


class Cohere2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = (
            config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        )
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
        if self.sliding_window is not None:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*input_shape, -1)), attn_weights


class Cohere2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Cohere2Attention(config, layer_idx)
        self.mlp = Cohere2MLP(config)
        self.input_layernorm = Cohere2LayerNorm(
            hidden_size=config.hidden_size, eps=config.layer_norm_eps
        )
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states_attention, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states_mlp = self.mlp(hidden_states)
        return residual + hidden_states_attention + hidden_states_mlp


def _additive(visible, dtype):
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


class Cohere2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            [Cohere2DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Cohere2LayerNorm(hidden_size=config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = Cohere2RotaryEmbedding(config=config)

    def forward(self, inputs_embeds):
        bsz, seq_len = inputs_embeds.shape[:2]
        position_ids = (
            torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0).expand(bsz, -1)
        )
        diff = position_ids[0][:, None] - position_ids[0][None, :]  # query index - key index
        causal = diff >= 0
        # the window counts the query itself, so look back sliding_window - 1 more tokens
        sliding = causal & (diff < self.config.sliding_window - 1)
        mask_mapping = {
            "full_attention": _additive(causal, inputs_embeds.dtype),
            "sliding_attention": _additive(sliding, inputs_embeds.dtype),
        }
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=mask_mapping[decoder_layer.attention_type],
            )
        return self.norm(hidden_states)


def make_cohere2():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=1,
        layer_types=["sliding_attention"],
        sliding_window=4,
        rope_theta=50000.0,
        layer_norm_eps=1e-5,
        attention_bias=False,
    )
    return Cohere2Model(config)


EXPECT = {
    "target": "make_cohere2",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "window_size",
    "layer": "layers.0.self_attn",
    "style": "HF Cohere2Model/Cohere2Attention (parallel attention + MLP on one Cohere2LayerNorm, repeat_interleave rotary with interleaved rotate_half on sliding layers, mask mapping by layer_types); window mask keeps i - j < sliding_window - 1 (3 keys for a declared 4)",
}
