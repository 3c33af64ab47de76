"""Phi-4-mini style decoder layer (HF Phi3 code path), written from scratch.

Fused qkv_proj sliced as [queries | keys | values], partial_rotary_factor 0.75 (12 of 16 dims,
rotate_half within the rotated slice), GQA 6:2 handed to SDPA with enable_gqa=True, boolean
causal mask built by the model body.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Phi3Config:
    hidden_size: int = 96
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    partial_rotary_factor: float = 0.75
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


class Phi3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class Phi3RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        dim = int(head_dim * config.partial_rotary_factor)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


class Phi3Attention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        op_size = self.head_dim * (self.num_heads + 2 * self.num_key_value_heads)
        self.qkv_proj = nn.Linear(config.hidden_size, op_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        query_pos = self.num_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        query_states = qkv[..., :query_pos]
        key_states = qkv[..., query_pos : query_pos + kv_size]
        value_states = qkv[..., query_pos + kv_size :]
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=attention_mask,
            scale=self.scaling,
            enable_gqa=True,
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Phi3Attention(config)
        self.input_layernorm = Phi3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return residual + self.self_attn(hidden_states, position_embeddings, attention_mask)


class Phi3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([Phi3DecoderLayer(config)])
        self.rotary_emb = Phi3RotaryEmbedding(config)
        self.norm = Phi3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        cache_position = torch.arange(n)
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        mask = cache_position[None, :] <= cache_position[:, None]
        mask = mask[None, None].expand(bsz, 1, n, n)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings)
        return self.norm(hidden_states)


def make_phi4_mini():
    torch.manual_seed(1002)
    model = Phi3Model(Phi3Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Phi3RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_phi4_mini",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 6,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.75, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Phi-4-mini (Phi3 code path): fused qkv_proj [q | k | v] slices, partial_rotary_factor 0.75 (12 of 16 dims, "
    "rotate_half), GQA 6:2 via SDPA enable_gqa=True, boolean causal mask from cache_position",
}
