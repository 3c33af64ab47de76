"""GPT-OSS (HF GptOssAttention) sliding layer with learned attention sinks.

Biased q/k/v/o projections, GQA 4:2, rotary by halves through torch.chunk (base 150000,
YaRN scaling left out), a sliding window of 8 on layer 0 built by the model, and a learned
per-head `sinks` logit concatenated as an extra column before the softmax and dropped
after it. The sink takes probability mass from every real key, which textbook attention
has no stage for; a careful checker should refuse rather than name a mistake.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class GptOssConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 150000.0
    sliding_window: int = 8
    rms_norm_eps: float = 1e-5
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])


class GptOssRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class GptOssRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(x.dtype) * self.inv_freq[None, None, :].to(x.dtype)
        return freqs.cos(), freqs.sin()


def _apply_rotary_emb(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return _apply_rotary_emb(q, cos, sin), _apply_rotary_emb(k, cos, sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined_logits = torch.cat([attn_weights, sinks], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = nn.functional.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]
    attn_output = torch.matmul(scores, value_states)
    return attn_output.transpose(1, 2).contiguous(), scores


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = (
            config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        )
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=True
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=True
        )
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_idx)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask)
        return residual + hidden_states


class GptOssModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([GptOssDecoderLayer(config, 0)])
        self.rotary_emb = GptOssRotaryEmbedding(config)
        self.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        pos = torch.arange(n)
        position_ids = pos.unsqueeze(0).expand(bsz, -1)
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        allowed = (pos[None, :] <= pos[:, None]) & (
            pos[:, None] - pos[None, :] < self.config.sliding_window
        )
        mask = torch.zeros(n, n, dtype=inputs_embeds.dtype).masked_fill(~allowed, min_dtype)
        mask = mask[None, None].expand(bsz, 1, n, n)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings)
        return self.norm(hidden_states)


def make_gptoss():
    torch.manual_seed(201)
    model = GptOssModel(GptOssConfig())
    with torch.no_grad():
        model.layers[0].self_attn.sinks.normal_(1.0, 0.5)
        model.layers[0].input_layernorm.weight.uniform_(0.5, 1.5)
        model.norm.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_gptoss",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "attention_sinks",
    "style": "HF GPT-OSS sliding layer (biased q/k/v/o, GQA 4:2, chunk-halves rotary base 150000, window 8 mask from the "
    "model) with learned per-head sinks concatenated to the logits before softmax and dropped after",
}
