"""InternLM3 (internlm3-8b-instruct remote modeling_internlm3.py) with a per-layer rotary override.

InternLM3ForCausalLM: model (embed_tokens, layers.N, norm) and lm_head.  InternLM3Attention:
q_proj/k_proj/v_proj/o_proj without bias (qkv_bias False), MQA-like GQA 4/1 (one kv head), rotary
from an `InternLM3RotaryEmbedding` holding `cos_cached`/`sin_cached` tables (rotate_half layout, base
5e4) indexed by position_ids, eager matmul / sqrt(head_dim), finfo.min causal mask, SiLU gated MLP.
Slip: layer 1 was given a per-layer `rope_scaling={"type": "linear", "factor": 2.0}` through its own
`InternLM3LinearScalingRotaryEmbedding`, but only the query path uses the scaled tables
(`query_pos = position_ids / factor`), while the keys use the plain table: queries and keys are
rotated at different positions.
No cache.
"""

import math
from types import SimpleNamespace

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
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": "InternLM3 remote code: cos_cached/sin_cached tables indexed by position_ids, GQA 4/1, base 5e4; "
    "layer 1's linear-scaling rotary divides only the query positions by 2",
}


class InternLM3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class InternLM3RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=50000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        self.inv_freq64 = inv_freq

    def forward(self, x, position_ids):
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


class InternLM3LinearScalingRotaryEmbedding(InternLM3RotaryEmbedding):
    def __init__(self, dim, max_position_embeddings=128, base=50000.0, scaling_factor=2.0):
        super().__init__(dim, max_position_embeddings, base)
        self.scaling_factor = scaling_factor

    def scaled(self, x, position_ids):
        t = position_ids.to(torch.float64) / self.scaling_factor
        freqs = t[..., None] * self.inv_freq64
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class InternLM3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=config.qkv_bias)
        scaling = config.layer_rope_scaling.get(layer_idx)
        if scaling is None:
            self.rotary_emb = InternLM3RotaryEmbedding(self.head_dim, base=config.rope_theta)
        else:
            self.rotary_emb = InternLM3LinearScalingRotaryEmbedding(
                self.head_dim, base=config.rope_theta, scaling_factor=scaling["factor"])

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, position_ids)
        if isinstance(self.rotary_emb, InternLM3LinearScalingRotaryEmbedding):
            q_cos, q_sin = self.rotary_emb.scaled(value_states, position_ids)
        else:
            q_cos, q_sin = cos, sin
        query_states = query_states * q_cos[:, None] + rotate_half(query_states) * q_sin[:, None]
        key_states = key_states * cos[:, None] + rotate_half(key_states) * sin[:, None]
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), None, None


class InternLM3DecoderLayer(nn.Module):
    def __init__(self, config, i):
        super().__init__()
        self.self_attn = InternLM3Attention(config, i)
        self.input_layernorm = InternLM3RMSNorm(config.hidden_size)
        self.post_attention_layernorm = InternLM3RMSNorm(config.hidden_size)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                             attention_mask=attention_mask, position_ids=position_ids)
        hidden_states = residual + hidden_states
        x = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class InternLM3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([InternLM3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = InternLM3RMSNorm(config.hidden_size)

    def forward(self, input_ids):
        bsz, n = input_ids.shape
        h = self.embed_tokens(input_ids)
        position_ids = torch.arange(n)[None].expand(bsz, n)
        mask = torch.zeros(n, n, dtype=h.dtype)
        mask = mask.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), torch.finfo(h.dtype).min)[None, None]
        for layer in self.layers:
            h = layer(h, mask, position_ids)
        return self.norm(h)


class InternLM3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = InternLM3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1206)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=1, qkv_bias=False, rope_theta=50000.0,
                             layer_rope_scaling={1: {"type": "linear", "factor": 2.0}})
    model = InternLM3ForCausalLM(config)
    g = torch.Generator().manual_seed(12061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, InternLM3RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
