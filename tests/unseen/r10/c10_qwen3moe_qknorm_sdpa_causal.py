"""HF Qwen3-MoE attention layer inside a sparse-MoE decoder layer (router omitted: one dense
expert), written from scratch.

Per-head Qwen3MoeRMSNorm q_norm/k_norm on head_dim applied before the rotary, GQA 4:2 via
repeat_kv, rope_theta 1e6 with the model-level rotary module, SDPA with is_causal=True and no
mask tensor (the sdpa_attention_forward convention for a full-length prompt).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Qwen3MoeConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    moe_intermediate_size: int = 32


class Qwen3MoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Qwen3MoeRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].double()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Qwen3MoeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.q_norm = Qwen3MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        is_causal = query_states.shape[2] > 1 and attention_mask is None
        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=attention_mask,
            scale=self.scaling,
            is_causal=is_causal,
        )
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(*input_shape, -1)
        return self.o_proj(attn_output), None


class Qwen3MoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.moe_intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = Qwen3MoeAttention(config, layer_idx)
        self.mlp = Qwen3MoeMLP(config)
        self.input_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3MoeRotaryEmbedding(config)

    def forward(self, hidden_states):
        bsz, n, _ = hidden_states.shape
        position_ids = torch.arange(n).unsqueeze(0).expand(bsz, -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, None)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def make_qwen3_moe_layer():
    torch.manual_seed(1010)
    layer = Qwen3MoeDecoderLayer(Qwen3MoeConfig())
    with torch.no_grad():
        for mod in layer.modules():
            if isinstance(mod, Qwen3MoeRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return layer.eval()


EXPECT = {
    "target": "make_qwen3_moe_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "HF Qwen3-MoE decoder layer (one dense expert): per-head RMS q_norm/k_norm before rotate_half rope (1e6), GQA 4:2 repeat_kv, "
    "SDPA is_causal=True with no mask tensor, MLP after the attention",
}
