"""Qwen2-VL language model, text path, with the values made by k_proj.

GQA 4:2 means k_proj and v_proj have the same shape, so value_states = self.k_proj(...)
runs without complaint: values are copies of the (unrotated) keys.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Qwen2VLTextConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    rope_scaling: dict = field(
        default_factory=lambda: {"type": "mrope", "mrope_section": [2, 3, 3]}
    )


class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Qwen2VLRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        # position_ids: (3, bs, seq)
        inv_freq_expanded = (
            self.inv_freq[None, None, :, None].to(x.dtype).expand(3, position_ids.shape[1], -1, 1)
        )
        position_ids_expanded = position_ids[:, :, None, :].to(x.dtype)
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    mrope_section = mrope_section * 2
    cos = torch.cat(
        [m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1
    ).unsqueeze(unsqueeze_dim)
    sin = torch.cat(
        [m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1
    ).unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Qwen2VLAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rope_scaling = config.rope_scaling
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.k_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_multimodal_rotary_pos_emb(
            query_states, key_states, cos, sin, self.rope_scaling["mrope_section"]
        )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(
            query_states.dtype
        )
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class Qwen2VLDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = Qwen2VLAttention(config, layer_idx)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return residual + self.self_attn(hidden_states, attention_mask, position_embeddings)


class Qwen2VLTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([Qwen2VLDecoderLayer(config, 0)])
        self.rotary_emb = Qwen2VLRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )
        self.norm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def get_rope_index(self, attention_mask):
        # text only: the three rows are the same running position
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        return position_ids.unsqueeze(0).expand(3, -1, -1)

    def forward(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        attention_mask = torch.ones(bsz, n, dtype=torch.long)
        position_ids = self.get_rope_index(attention_mask)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        causal_mask = torch.triu(
            torch.full((n, n), min_dtype, dtype=inputs_embeds.dtype), diagonal=1
        )
        causal_mask = causal_mask[None, None].expand(bsz, 1, n, n)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, position_embeddings)
        return self.norm(hidden_states)


def make_qwen2vl_text():
    torch.manual_seed(103)
    model = Qwen2VLTextModel(Qwen2VLTextConfig())
    with torch.no_grad():
        model.layers[0].input_layernorm.weight.uniform_(0.5, 1.5)
        model.norm.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_qwen2vl_text",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "values",
    "mistake": "wrong_projection",
    "style": "HF Qwen2-VL text path (M-RoPE sections, biased q/k/v, GQA 4:2): value_states projected with k_proj",
}
