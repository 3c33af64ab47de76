"""Aphrodite-engine style decoder attention (the PygmalionAI inference engine, a vLLM fork): one
fused QKVParallelLinear-like qkv_proj split with .split([q_size, kv_size, kv_size]), a
RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style) module called as
rotary_emb(positions, q, k) on the flat [tokens, heads * head_size] layout, and an Attention
backend object holding num_heads / num_kv_heads / scale / sliding_window. The paged-KV backend is
replaced by a torch-native prefill path (GQA by repeat_interleave, causal + sliding-window mask).
Positions are built by the model runner and passed in.

This file: one bug: the prefill path builds an all-true mask (the encoder-only branch of the backend), so tokens see the future."""

import torch
from torch import nn


class ModelConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 500000.0
    partial_rotary_factor = 0.5
    is_neox_style = False
    sliding_window = None
    max_position_embeddings = 256
    rms_norm_eps = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon) * self.weight
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        # [max_position, rotary_dim]: first half cos, second half sin (vLLM layout)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def _rotate(self, x, cos, sin):
        cos = cos.unsqueeze(-2).to(x.dtype)
        sin = sin.unsqueeze(-2).to(x.dtype)
        if self.is_neox_style:
            x1, x2 = torch.chunk(x, 2, dim=-1)
        else:
            x1 = x[..., ::2]
            x2 = x[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.is_neox_style:
            return torch.cat((o1, o2), dim=-1)
        return torch.stack((o1, o2), dim=-1).flatten(-2)

    def _rotate_heads(self, positions, x):
        shape = x.shape
        x = x.view(*shape[:-1], -1, self.head_size)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        x_rot = self._rotate(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((x_rot, x[..., self.rotary_dim :]), dim=-1).reshape(shape)

    def forward(self, positions, query, key):
        return self._rotate_heads(positions, query), self._rotate_heads(positions, key)


class Attention(nn.Module):
    """Torch-native prefill backend: q [b, t, h*d], k/v [b, t, kv*d]."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window

    def forward(self, query, key, value):
        b, t, _ = query.shape
        q = query.view(b, t, self.num_heads, self.head_size).transpose(1, 2)
        k = key.view(b, t, self.num_kv_heads, self.head_size).transpose(1, 2)
        v = value.view(b, t, self.num_kv_heads, self.head_size).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale
        pos = torch.arange(t, device=query.device)
        dist = pos[:, None] - pos[None, :]
        allowed = torch.ones_like(dist, dtype=torch.bool)
        if self.sliding_window is not None:
            allowed = allowed & (dist < self.sliding_window)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        return out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_size)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(self.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, self.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            int(self.head_dim * config.partial_rotary_factor),
            config.max_position_embeddings,
            config.rope_theta,
            config.is_neox_style,
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.scaling, self.num_kv_heads,
            sliding_window=config.sliding_window,
        )

    def forward(self, positions, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 256, bias=False)
        self.down_proj = nn.Linear(128, config.hidden_size, bias=False)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up), residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        b, t, _ = inputs_embeds.shape
        positions = torch.arange(t, device=inputs_embeds.device).unsqueeze(0).expand(b, t)
        hidden_states, residual = inputs_embeds, None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def make_aphrodite_llama():
    torch.manual_seed(2120)
    model = LlamaModel(ModelConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.6, 1.4)
    return model.eval()


EXPECT = {
    "target": "make_aphrodite_llama",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": 'masked_scores',
    "mistake": 'missing_mask',
    "style": 'Aphrodite-engine torch-native prefill: causal part of the mask dropped',
}
