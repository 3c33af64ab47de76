"""EXAONE-3.0 remote-code-style transformer body (h[i].attn.attention, GQA 8:2, rotary theta 1e6); bug: the
attention output (b, heads, s, d) is reshaped to (b, s, hidden) without first moving the heads behind the tokens."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class ExaoneRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class ExaoneRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        base = config.rope_theta
        self.register_buffer(
            "inv_freq",
            1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(self.inv_freq.dtype) * self.inv_freq
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


class ExaoneSelfAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout_rate = config.attention_dropout
        self.q_proj = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.embed_dim, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.embed_dim, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, self.embed_dim, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
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
        attn_weights = F.dropout(
            attn_weights, p=self.attention_dropout_rate, training=self.training
        )
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.contiguous().reshape(bsz, q_len, self.embed_dim)
        return self.out_proj(attn_output), attn_weights


class ExaoneAttention(nn.Module):
    def __init__(self, config, layer_id=0):
        super().__init__()
        self.attention = ExaoneSelfAttention(config, layer_id)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        return self.attention(
            hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings
        )


class ExaoneGatedMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc_0 = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.c_fc_1 = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.c_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.c_proj(F.silu(self.c_fc_0(hidden_states)) * self.c_fc_1(hidden_states))


class ExaoneBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.ln_1 = ExaoneRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = ExaoneAttention(config, layer_id)
        self.ln_2 = ExaoneRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = ExaoneGatedMLP(config.intermediate_size, config)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        attn_output, _ = self.attn(
            self.ln_1(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + attn_output
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class ExaoneModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([ExaoneBlock(config, layer_id=i) for i in range(config.num_layers)])
        self.ln_f = ExaoneRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.rotary = ExaoneRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len = inputs_embeds.shape[:2]
        position_ids = torch.arange(
            seq_len, dtype=torch.long, device=inputs_embeds.device
        ).unsqueeze(0)
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        causal_mask = torch.triu(
            torch.full((seq_len, seq_len), min_dtype, dtype=inputs_embeds.dtype), diagonal=1
        )
        causal_mask = causal_mask[None, None].expand(bsz, 1, -1, -1)
        position_embeddings = self.rotary(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(
                hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings
            )
        return self.ln_f(hidden_states)


def make_exaone():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=128,
        num_layers=1,
        rope_theta=1000000.0,
        layer_norm_epsilon=1e-5,
        attention_dropout=0.0,
    )
    return ExaoneModel(config)


EXPECT = {
    "target": "make_exaone",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "output",
    "mistake": "heads_merge",
    "layer": "h.0.attn.attention",
    "style": "EXAONE-3.0 remote code (transformer.h[i].attn.attention ExaoneSelfAttention, q/k/v/out_proj, GQA repeat_kv, ln_1/ln_2 RMSNorm, gated c_fc_0/c_fc_1 MLP); attn_output.reshape(bsz, q_len, embed_dim) without transpose(1, 2)",
}
