"""DeepSeek(-Coder/MoE) remote-code style model body: MHA, rotary theta 1e5 with linear position scaling (factor 4), position ids from the attention mask."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class DeepseekRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class DeepseekRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _positions(self, seq_len):
        return torch.arange(seq_len, dtype=self.inv_freq.dtype)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        freqs = torch.outer(self._positions(seq_len), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


class DeepseekLinearScalingRotaryEmbedding(DeepseekRotaryEmbedding):
    """Position interpolation: every position is divided by scaling_factor before the angles are taken."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000, scaling_factor=1.0):
        self.scaling_factor = scaling_factor
        super().__init__(dim, max_position_embeddings, base)

    def _positions(self, seq_len):
        return torch.arange(seq_len, dtype=self.inv_freq.dtype) / self.scaling_factor


def rotate_half(x):
    """(first half, second half) -> (-second half, first half)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class DeepseekAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
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
        self._init_rope()

    def _init_rope(self):
        scaling = self.config.rope_scaling
        if scaling is None:
            self.rotary_emb = DeepseekRotaryEmbedding(
                self.head_dim, self.config.max_position_embeddings, base=self.config.rope_theta
            )
        elif scaling["type"] == "linear":
            self.rotary_emb = DeepseekLinearScalingRotaryEmbedding(
                self.head_dim,
                max_position_embeddings=self.config.max_position_embeddings,
                scaling_factor=scaling["factor"],
                base=self.config.rope_theta,
            )
        else:
            raise ValueError(f"Unknown RoPE scaling type {scaling['type']}")

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
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

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), attn_weights


class DeepseekMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DeepseekAttention(config, layer_idx)
        self.mlp = DeepseekMLP(config)
        self.input_layernorm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _prepare_4d_causal_attention_mask(attention_mask, dtype):
    """(b, s) padding mask -> (b, 1, s, s) additive mask, causal and padding-aware."""
    bsz, seq_len = attention_mask.shape
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=attention_mask.device).tril()
    keep = causal[None] & attention_mask[:, None, :].bool()
    out = torch.zeros(bsz, seq_len, seq_len, dtype=dtype, device=attention_mask.device)
    return out.masked_fill(~keep, torch.finfo(dtype).min)[:, None]


class DeepseekModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds, attention_mask=None):
        bsz, seq_len, _ = inputs_embeds.shape
        if attention_mask is None:
            attention_mask = torch.ones(bsz, seq_len, dtype=torch.long, device=inputs_embeds.device)
        # as in generate(): left padding gets position 1, real tokens count from 0
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        mask_4d = _prepare_4d_causal_attention_mask(attention_mask, inputs_embeds.dtype)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=mask_4d, position_ids=position_ids
            )
        return self.norm(hidden_states)


def make_deepseek():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_hidden_layers=1,
        rope_theta=100000,
        rope_scaling={"type": "linear", "factor": 4.0},
        max_position_embeddings=64,
        attention_bias=False,
        rms_norm_eps=1e-6,
    )
    return DeepseekModel(config)


EXPECT = {
    "target": "make_deepseek",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 100000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "DeepSeek-Coder/DeepSeek-MoE remote code (DeepseekLinearScalingRotaryEmbedding factor 4 on theta 1e5, cos_cached[position_ids], position_ids = mask.cumsum - 1, 4D additive mask)",
}
