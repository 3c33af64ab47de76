"""InternLM2-style model body: one wqkv projection laid out per kv group as [q_1..q_r, k, v], GQA 8:2, rotary theta 1e6."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


class InternLM2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class InternLM2RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=256, base=1000000):
        super().__init__()
        inv_freq = torch.pow(float(base), -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class InternLM2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.wqkv = nn.Linear(
            self.hidden_size,
            (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim,
            bias=config.bias,
        )
        self.wo = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=config.bias)
        self.rotary_emb = InternLM2RotaryEmbedding(
            self.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            base=config.rope_theta,
        )

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        qkv_states = self.wqkv(hidden_states)
        qkv_states = rearrange(
            qkv_states,
            "b q (h gs d) -> b q h gs d",
            gs=2 + self.num_key_value_groups,
            d=self.head_dim,
        )
        query_states = rearrange(
            qkv_states[..., : self.num_key_value_groups, :], "b q h gs d -> b q (h gs) d"
        )
        key_states = qkv_states[..., -2, :]
        value_states = qkv_states[..., -1, :]

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )

        key_states = torch.repeat_interleave(key_states, self.num_key_value_groups, dim=1)
        value_states = torch.repeat_interleave(value_states, self.num_key_value_groups, dim=1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.wo(attn_output), attn_weights


class InternLM2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class InternLM2DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = InternLM2Attention(config)
        self.feed_forward = InternLM2MLP(config)
        self.attention_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        residual = hidden_states
        hidden_states, _ = self.attention(
            self.attention_norm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states))


def _make_causal_mask(bsz, tgt_len, dtype, device, past_key_values_length=0):
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat(
            [torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1
        )
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class InternLM2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [InternLM2DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        batch_size, seq_length = inputs_embeds.shape[:2]
        past_key_values_length = 0
        position_ids = torch.arange(
            past_key_values_length,
            seq_length + past_key_values_length,
            dtype=torch.long,
            device=inputs_embeds.device,
        ).unsqueeze(0)
        attention_mask = _make_causal_mask(
            batch_size,
            seq_length,
            inputs_embeds.dtype,
            inputs_embeds.device,
            past_key_values_length,
        )
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids
            )
        return self.norm(hidden_states)


def make_internlm2():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=1,
        rope_theta=1000000,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bias=False,
    )
    return InternLM2Model(config)


EXPECT = {
    "target": "make_internlm2",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "InternLM2 remote code (wqkv rearranged 'b q (h gs d) -> b q h gs d', gs = groups + 2, wo, _make_causal_mask, attention/attention_norm/feed_forward names)",
}
