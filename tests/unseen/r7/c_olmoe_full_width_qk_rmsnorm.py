"""OLMoE-style model body: RMSNorm over the whole q projection (64) and the whole k projection (32, GQA 4:2)
before the head split, rotary half pairing; the model counts positions from 1 (mask.cumsum), a uniform shift."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class OlmoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class OlmoeRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = torch.einsum("bs,d->bsd", position_ids.to(self.inv_freq.dtype), self.inv_freq)
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


class OlmoeAttention(nn.Module):
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
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=config.attention_bias)
        self.q_norm = OlmoeRMSNorm(self.hidden_size, eps=config.rms_norm_eps)
        self.k_norm = OlmoeRMSNorm(
            self.head_dim * self.num_key_value_heads, eps=config.rms_norm_eps
        )

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        if self.config.clip_qkv is not None:
            query_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            key_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            value_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(
            1, 2
        )
        value_states = value_states.view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        ).transpose(1, 2)

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
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), attn_weights


class OlmoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OlmoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([OlmoeMLP(config) for _ in range(config.num_experts)])

    def forward(self, hidden_states):
        routing_weights = F.softmax(self.gate(hidden_states), dim=-1)
        top_w, top_i = torch.topk(routing_weights, self.top_k, dim=-1)
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts):
            weight = (top_w * (top_i == e)).sum(-1, keepdim=True)
            out = out + weight * expert(hidden_states)
        return out


class OlmoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = OlmoeAttention(config=config, layer_idx=layer_idx)
        self.mlp = OlmoeSparseMoeBlock(config)
        self.input_layernorm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class OlmoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [OlmoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = OlmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OlmoeRotaryEmbedding(config)

    def forward(self, inputs_embeds, attention_mask=None):
        bsz, seq_len = inputs_embeds.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(bsz, seq_len, dtype=torch.long, device=inputs_embeds.device)
        # the packing collator's convention: the first real token has position 1
        position_ids = attention_mask.long().cumsum(-1)
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        causal = torch.full(
            (seq_len, seq_len), min_dtype, dtype=inputs_embeds.dtype, device=inputs_embeds.device
        )
        causal = torch.triu(causal, diagonal=1)[None, None]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=causal, position_embeddings=position_embeddings
            )
        return self.norm(hidden_states)


def make_olmoe():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        attention_bias=False,
        clip_qkv=None,
    )
    model = OlmoeModel(config)
    g = torch.Generator().manual_seed(23)
    with torch.no_grad():
        attn = model.layers[0].self_attn
        attn.q_norm.weight.copy_(0.5 + torch.rand(64, generator=g))
        attn.k_norm.weight.copy_(0.5 + torch.rand(32, generator=g))
    return model


EXPECT = {
    "target": "make_olmoe",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": "full",
        "window": None,
        "bias": None,
    },
    "style": "HF OlmoeModel/OlmoeAttention (q_norm = RMSNorm(hidden_size), k_norm = RMSNorm(head_dim * kv_heads) on the projections, clip_qkv None, sparse MoE; position_ids = mask.cumsum(-1), i.e. 1-based: a uniform shift)",
}
