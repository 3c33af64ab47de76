"""Persimmon-style decoder layer: fused query_key_value laid out per head as [q, k, v], LayerNorm on q and k, half of each head rotated."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class PersimmonRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=256, base=25000):
        super().__init__()
        self.dim = dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    """(first half, second half) -> (-second half, first half)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # (b, 1, s, rot)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class PersimmonAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=True)
        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(
                self.head_dim, eps=config.layer_norm_eps, elementwise_affine=True
            )
            self.k_layernorm = nn.LayerNorm(
                self.head_dim, eps=config.layer_norm_eps, elementwise_affine=True
            )
        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.rotary_emb = PersimmonRotaryEmbedding(
            self.rotary_ndims,
            max_position_embeddings=config.max_position_embeddings,
            base=config.rope_theta,
        )

    def _split_heads(self, fused_qkv):
        """[b, s, h * 3 * d] -> three [b, s, h, d] tensors (the checkpoint stores q, k, v per head)."""
        batch_size, seq_length, _ = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._split_heads(
            self.query_key_value(hidden_states)
        )

        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_rot, query_pass = (
            query_states[..., : self.rotary_ndims],
            query_states[..., self.rotary_ndims :],
        )
        key_rot, key_pass = (
            key_states[..., : self.rotary_ndims],
            key_states[..., self.rotary_ndims :],
        )
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin, position_ids)
        query_states = torch.cat((query_rot, query_pass), dim=-1)
        key_states = torch.cat((key_rot, key_pass), dim=-1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = self.attention_dropout(attn_weights)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.dense(attn_output), attn_weights


class PersimmonMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(torch.relu(self.dense_h_to_4h(hidden_states)) ** 2)


class PersimmonDecoderLayer(nn.Module):
    """Builds its own causal mask and position ids so it can be called with hidden states alone."""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = PersimmonAttention(config, layer_idx)
        self.mlp = PersimmonMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, seq_len, _ = hidden_states.shape
        if position_ids is None:
            position_ids = (
                torch.arange(seq_len, device=hidden_states.device).unsqueeze(0).repeat(bsz, 1)
            )
        if attention_mask is None:
            neg = torch.finfo(hidden_states.dtype).min
            attention_mask = torch.triu(
                torch.full(
                    (seq_len, seq_len), neg, dtype=hidden_states.dtype, device=hidden_states.device
                ),
                1,
            )[None, None]
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        return residual + hidden_states


def make_decoder_layer():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        partial_rotary_factor=0.5,
        rope_theta=25000.0,
        max_position_embeddings=256,
        qk_layernorm=True,
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    layer = PersimmonDecoderLayer(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for ln in (layer.self_attn.q_layernorm, layer.self_attn.k_layernorm):
            ln.weight.copy_(0.6 + 0.8 * torch.rand(ln.weight.shape, generator=g))
            ln.bias.copy_(0.2 * torch.randn(ln.bias.shape, generator=g))
    return layer


EXPECT = {
    "target": "make_decoder_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 25000},
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "HF PersimmonAttention/PersimmonDecoderLayer (query_key_value viewed (b, s, h, 3, d), q/k LayerNorm(head_dim) with bias, rotary_ndims = head_dim/2, theta 25000, dense)",
}
