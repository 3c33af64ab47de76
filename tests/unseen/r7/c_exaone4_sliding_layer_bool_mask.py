"""EXAONE-4.0-style model with one sliding-attention layer: GQA 6:2, per-head RMSNorm on q and k, rotary (theta 1e6)
only on sliding layers, post-norm residuals, window of 6 passed to SDPA as a boolean mask from the model's mask mapping."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class Exaone4RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class Exaone4RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        self.register_buffer(
            "inv_freq",
            1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    def forward(self, x, position_ids):
        freqs = position_ids.to(self.inv_freq.dtype)[..., None] * self.inv_freq
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


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0):
    return (
        F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=True,
        )
        .transpose(1, 2)
        .contiguous()
    )


class Exaone4Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.hidden_size = config.hidden_size
        self.head_dim = config.head_dim
        self.num_key_value_groups = self.num_attention_heads // self.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.q_proj = nn.Linear(
            self.hidden_size, self.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            self.num_attention_heads * self.head_dim, self.hidden_size, bias=False
        )
        self.q_norm = Exaone4RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Exaone4RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)

        cos, sin = position_embeddings
        # hybrid models rotate only on the sliding layers; the global layers use no positional encoding
        if self.sliding_window is None or self.is_sliding:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output = sdpa_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), None


class Exaone4MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Exaone4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Exaone4Attention(config=config, layer_idx=layer_idx)
        self.mlp = Exaone4MLP(config)
        self.post_attention_layernorm = Exaone4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Exaone4RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return residual + hidden_states


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window

    return inner_mask


def and_masks(*mask_functions):
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result

    return and_mask


def sdpa_mask(seq_len, mask_function, device):
    """Evaluate a mask_mod on the full grid: (1, 1, q, kv) boolean, True = may attend."""
    q_idx = torch.arange(seq_len, device=device)[:, None]
    kv_idx = torch.arange(seq_len, device=device)[None, :]
    return mask_function(None, None, q_idx, kv_idx)[None, None]


class Exaone4Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            [Exaone4DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Exaone4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Exaone4RotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len = inputs_embeds.shape[:2]
        position_ids = torch.arange(seq_len, device=inputs_embeds.device)[None].expand(bsz, -1)
        causal_mask_mapping = {
            "full_attention": sdpa_mask(seq_len, causal_mask_function, inputs_embeds.device),
            "sliding_attention": sdpa_mask(
                seq_len,
                and_masks(causal_mask_function, sliding_window_overlay(self.config.sliding_window)),
                inputs_embeds.device,
            ),
        }
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask_mapping[decoder_layer.attention_type],
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states)


def make_exaone4():
    config = SimpleNamespace(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        num_hidden_layers=1,
        layer_types=["sliding_attention"],
        sliding_window=6,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
    )
    model = Exaone4Model(config)
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        attn = model.layers[0].self_attn
        attn.q_norm.weight.copy_(0.4 + 1.2 * torch.rand(16, generator=g))
        attn.k_norm.weight.copy_(0.4 + 1.2 * torch.rand(16, generator=g))
    return model


EXPECT = {
    "target": "make_exaone4",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 6,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": "per-head",
        "window": 6,
        "bias": None,
    },
    "style": "HF Exaone4Model/Exaone4Attention (layer_types sliding_attention, q_norm/k_norm RMSNorm(head_dim), rope only on sliding layers, post-norm residuals, causal_mask_mapping from and_masks(causal, sliding_window_overlay) evaluated to a bool SDPA mask, enable_gqa)",
}
