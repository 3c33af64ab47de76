"""Nemotron-style model body: GQA 8:2, rotary on half of each head, LayerNorm1P pre-norms, squared-ReLU MLP."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class NemotronLayerNorm1P(nn.LayerNorm):
    """LayerNorm whose stored weight is zero-centred: the applied gain is 1 + weight."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class NemotronRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        dim = int(head_dim * config.partial_rotary_factor)
        self.register_buffer(
            "inv_freq",
            config.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim),
            persistent=False,
        )

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(self.inv_freq.dtype) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    """(first half, second half) -> (-second half, first half)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Rotates the leading cos.shape[-1] features of every head and passes the rest through."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


def repeat_kv(hidden_states, n_rep):
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d): kv head g serves query heads g * n_rep ... g * n_rep + n_rep - 1."""
    if n_rep == 1:
        return hidden_states
    b, kv_heads, s, d = hidden_states.shape
    return hidden_states.unsqueeze(2).expand(b, kv_heads, n_rep, s, d).flatten(1, 2)


class NemotronAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.partial_rotary_factor = config.partial_rotary_factor
        self.q_proj = nn.Linear(
            self.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, self.hidden_size, bias=config.attention_bias
        )

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
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

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights


class NemotronMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)) ** 2)


class NemotronDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = NemotronAttention(config=config, layer_idx=layer_idx)
        self.mlp = NemotronMLP(config)
        self.input_layernorm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class NemotronModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [NemotronDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)
        self.rotary_emb = NemotronRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len = inputs_embeds.shape[:2]
        cache_position = torch.arange(0, seq_len, device=inputs_embeds.device)
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        causal_mask = torch.full(
            (seq_len, seq_len), fill_value=min_dtype, dtype=inputs_embeds.dtype
        )
        causal_mask = causal_mask * (torch.arange(seq_len) > cache_position.reshape(-1, 1))
        causal_mask = causal_mask[None, None].expand(bsz, 1, -1, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings
            )
        return self.norm(hidden_states)


def make_nemotron():
    config = SimpleNamespace(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=256,
        num_hidden_layers=1,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
    )
    return NemotronModel(config)


EXPECT = {
    "target": "make_nemotron",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF NemotronModel/NemotronAttention (partial_rotary_factor=0.5 inside apply_rotary_pos_emb via cos.shape[-1], NemotronLayerNorm1P, repeat_kv, relu^2 MLP, mask = min * (arange > cache_position))",
}
