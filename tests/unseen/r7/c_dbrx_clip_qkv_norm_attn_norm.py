"""DBRX-style model body: fused Wqkv clamped to +-clip_qkv, GQA 8:2, rotary theta 5e5, attention inside norm_attn_norm, tiny MoE FFN."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class DbrxRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].to(self.inv_freq.dtype)
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


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


class DbrxAttention(nn.Module):
    def __init__(self, config, block_idx=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.d_model
        self.num_heads = config.n_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.block_idx = block_idx
        attn_config = config.attn_config
        self.attn_pdrop = attn_config.attn_pdrop
        self.clip_qkv = attn_config.clip_qkv
        self.num_key_value_heads = attn_config.kv_n_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rope_theta = attn_config.rope_theta
        self.Wqkv = nn.Linear(
            self.hidden_size,
            self.hidden_size + 2 * self.num_key_value_heads * self.head_dim,
            bias=False,
        )
        self.out_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = DbrxRotaryEmbedding(self.head_dim, base=self.rope_theta)

    def forward(self, hidden_states, position_ids, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        qkv_states = self.Wqkv(hidden_states)
        min_val = -self.clip_qkv if self.clip_qkv is not None else None
        max_val = self.clip_qkv
        qkv_states = qkv_states.clamp(min=min_val, max=max_val)

        query_states, key_states, value_states = qkv_states.split(
            [
                self.hidden_size,
                self.num_key_value_heads * self.head_dim,
                self.num_key_value_heads * self.head_dim,
            ],
            dim=2,
        )
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(
            1, 2
        )
        value_states = value_states.view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        ).transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = F.dropout(attn_weights, p=self.attn_pdrop, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.out_proj(attn_output), attn_weights


class DbrxNormAttentionNorm(nn.Module):
    def __init__(self, config, block_idx=None):
        super().__init__()
        self.block_idx = block_idx
        self.resid_pdrop = config.resid_pdrop
        self.norm_1 = nn.LayerNorm(config.d_model, bias=False)
        self.attn = DbrxAttention(config=config, block_idx=block_idx)
        self.norm_2 = nn.LayerNorm(config.d_model, bias=False)

    def forward(self, hidden_states, position_ids, attention_mask=None):
        residual_states = hidden_states
        hidden_states = self.norm_1(hidden_states).to(hidden_states.dtype)
        hidden_states, attn_weights = self.attn(
            hidden_states, position_ids=position_ids, attention_mask=attention_mask
        )
        hidden_states = F.dropout(hidden_states, p=self.resid_pdrop, training=self.training)
        hidden_states = hidden_states + residual_states
        residual_states = hidden_states
        hidden_states = self.norm_2(hidden_states).to(hidden_states.dtype)
        return residual_states, hidden_states, attn_weights


class DbrxFFN(nn.Module):
    """Top-1 routed GLU experts (a very small version of DbrxExperts)."""

    def __init__(self, config):
        super().__init__()
        ffn = config.ffn_config
        self.router = nn.Linear(config.d_model, ffn.moe_num_experts, bias=False)
        self.w1 = nn.Parameter(
            torch.randn(ffn.moe_num_experts, ffn.ffn_hidden_size, config.d_model) * 0.05
        )
        self.v1 = nn.Parameter(
            torch.randn(ffn.moe_num_experts, ffn.ffn_hidden_size, config.d_model) * 0.05
        )
        self.w2 = nn.Parameter(
            torch.randn(ffn.moe_num_experts, ffn.ffn_hidden_size, config.d_model) * 0.05
        )

    def forward(self, x):
        weights = self.router(x).softmax(dim=-1)
        top_w, top_e = weights.max(dim=-1)
        w1, v1, w2 = self.w1[top_e], self.v1[top_e], self.w2[top_e]  # (b, s, f, d)
        h = F.silu(torch.einsum("bsd,bsfd->bsf", x, w1)) * torch.einsum("bsd,bsfd->bsf", x, v1)
        return torch.einsum("bsf,bsfd->bsd", h, w2) * top_w[..., None]


class DbrxBlock(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.norm_attn_norm = DbrxNormAttentionNorm(config=config, block_idx=block_idx)
        self.ffn = DbrxFFN(config=config)

    def forward(self, hidden_states, position_ids, attention_mask=None):
        resid_states, hidden_states, _ = self.norm_attn_norm(
            hidden_states, position_ids, attention_mask
        )
        return resid_states + self.ffn(hidden_states)


class DbrxModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList(
            [DbrxBlock(config, block_idx) for block_idx in range(config.n_layers)]
        )
        self.norm_f = nn.LayerNorm(config.d_model, bias=False)

    def forward(self, inputs_embeds):
        bsz, seq_len = inputs_embeds.shape[:2]
        position_ids = (
            torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0).expand(bsz, -1)
        )
        causal = torch.zeros(
            seq_len, seq_len, dtype=inputs_embeds.dtype, device=inputs_embeds.device
        )
        causal = causal.masked_fill(
            torch.ones_like(causal, dtype=torch.bool).triu(1), torch.finfo(inputs_embeds.dtype).min
        )[None, None]
        hidden_states = inputs_embeds
        for block in self.blocks:
            hidden_states = block(hidden_states, position_ids, attention_mask=causal)
        return self.norm_f(hidden_states)


def make_dbrx():
    config = SimpleNamespace(
        d_model=64,
        n_heads=8,
        n_layers=1,
        resid_pdrop=0.0,
        attn_config=SimpleNamespace(
            attn_pdrop=0.0, clip_qkv=8.0, kv_n_heads=2, rope_theta=500000.0
        ),
        ffn_config=SimpleNamespace(ffn_hidden_size=96, moe_num_experts=2),
    )
    return DbrxModel(config)


EXPECT = {
    "target": "make_dbrx",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.norm_attn_norm.attn",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 500000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF DbrxModel/DbrxAttention (Wqkv clamped to clip_qkv=8, split [d, kv*hd, kv*hd], rotary_emb in the attention with position_ids, blocks[i].norm_attn_norm.attn, top-1 MoE ffn)",
}
