"""A tiny Persimmon (Adept) in the style of modeling_persimmon.py (no cache).

PersimmonForCausalLM -> model (embed_tokens, layers ModuleList, final_layernorm) + lm_head.
LayerNorm everywhere, relu^2 MLP (dense_h_to_4h / dense_4h_to_h).  Attention: fused
query_key_value with bias viewed (b, s, heads, 3, head_dim) per head; qk_layernorm: q_layernorm
and k_layernorm are LayerNorm(head_dim) with their own (non-uniform) weights and biases, applied
to queries and keys BEFORE the partial rotary (partial_rotary_factor 0.5: 8 of 16 dims, halves
layout, base 25000); 4 heads of 16; additive finfo.min causal mask; dense output projection.
config.fused_qk_rope_layers = (1,) sends layer 1 through a "fused" path (one helper that
normalises and rotates).

Slip: the fused helper rotates first and normalises afterwards.  A LayerNorm with per-feature
weights does not commute with the rotation, so queries and keys differ.  model.layers.1.self_attn,
normed_queries, qk_norm_misplaced.  Layers 0 and 2 are correct.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "transformers modeling_persimmon.py: fused per-head query_key_value, per-head LayerNorm qk norm, "
    "partial rotary 0.5; slip: the fused norm+rope helper of layer 1 rotates before normalising",
}


@dataclass
class PersimmonConfig:
    vocab_size: int = 140
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    layer_norm_eps: float = 1e-5
    rope_theta: float = 25000.0
    partial_rotary_factor: float = 0.5
    qk_layernorm: bool = True
    fused_qk_rope_layers: tuple = (1,)


class PersimmonRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(x.dtype) * self.inv_freq[None, None, :].to(x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rotary(x, cos, sin, rotary_ndims):
    x_rot, x_pass = x[..., :rotary_ndims], x[..., rotary_ndims:]
    x_rot = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat((x_rot, x_pass), dim=-1)


class PersimmonAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=True)
        self.q_layernorm = nn.LayerNorm(
            self.head_dim, eps=config.layer_norm_eps, elementwise_affine=True
        )
        self.k_layernorm = nn.LayerNorm(
            self.head_dim, eps=config.layer_norm_eps, elementwise_affine=True
        )
        self.rotary_emb = PersimmonRotaryEmbedding(self.rotary_ndims, config.rope_theta)
        self.fused_qk_rope = layer_idx in config.fused_qk_rope_layers

    def _split_heads(self, fused_qkv):
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _fused_norm_rope(self, q, k, cos, sin):
        q = apply_partial_rotary(q, cos, sin, self.rotary_ndims)  # SLIP
        k = apply_partial_rotary(k, cos, sin, self.rotary_ndims)  # SLIP
        return self.q_layernorm(q), self.k_layernorm(k)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._split_heads(
            self.query_key_value(hidden_states)
        )
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.fused_qk_rope:
            query_states, key_states = self._fused_norm_rope(query_states, key_states, cos, sin)
        else:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)
            query_states = apply_partial_rotary(query_states, cos, sin, self.rotary_ndims)
            key_states = apply_partial_rotary(key_states, cos, sin, self.rotary_ndims)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / self.head_dim**0.5
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.dense(attn_output)


class PersimmonMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(torch.relu(self.dense_h_to_4h(hidden_states)) ** 2)


class PersimmonDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = PersimmonAttention(config, layer_idx)
        self.mlp = PersimmonMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PersimmonModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [PersimmonDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        min_dtype = torch.finfo(hidden_states.dtype).min
        mask = torch.triu(
            torch.full((seq_len, seq_len), min_dtype, dtype=hidden_states.dtype), diagonal=1
        )[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_ids)
        return self.final_layernorm(hidden_states)


class PersimmonForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = PersimmonModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(8)
    model = PersimmonForCausalLM(PersimmonConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.4 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()
