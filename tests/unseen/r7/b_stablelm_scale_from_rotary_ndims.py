"""StableLM-2 style decoder stack (GQA 4:2, partial rotary on 25% of each head, per-head q/k LayerNorms); bug: the
scores are divided by sqrt(rotary_ndims) (the rotated width, 4) instead of sqrt(head_dim) (16): 1/2 instead of 1/4."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StableLmRotaryEmbedding(nn.Module):
    """cos/sin for the rotated slice of every head, looked up by position id."""

    def __init__(self, dim, base):
        super().__init__()
        exponents = torch.arange(0, dim, 2).double() / dim
        self.register_buffer("inv_freq", base**-exponents, persistent=False)

    def forward(self, x, position_ids):
        angles = position_ids[..., None].to(self.inv_freq.dtype) * self.inv_freq  # (b, s, dim/2)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


class StableLmLayerNormPerHead(nn.Module):
    """A separate (bias-free) LayerNorm for every head."""

    def __init__(self, dim, num_heads, eps=1e-5):
        super().__init__()
        self.norms = nn.ModuleList(
            [nn.LayerNorm(dim, eps=eps, bias=False) for _ in range(num_heads)]
        )

    def forward(self, hidden_states):
        # hidden_states: (batch, heads, seq, head_dim)
        per_head = torch.split(hidden_states, 1, dim=1)
        return torch.cat([norm(h) for norm, h in zip(self.norms, per_head)], dim=1)


class StableLmAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.q_proj = nn.Linear(
            self.hidden_size, self.num_heads * self.head_dim, bias=config.use_qkv_bias
        )
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.use_qkv_bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.use_qkv_bias
        )
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = StableLmLayerNormPerHead(
                self.head_dim, self.num_heads, eps=config.layer_norm_eps
            )
            self.k_layernorm = StableLmLayerNormPerHead(
                self.head_dim, self.num_key_value_heads, eps=config.layer_norm_eps
            )

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        bsz, q_len, _ = hidden_states.shape
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

        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)

        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rot, q_pass = (
            query_states[..., : self.rotary_ndims],
            query_states[..., self.rotary_ndims :],
        )
        k_rot, k_pass = key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims :]
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        query_states = torch.cat((q_rot, q_pass), dim=-1)
        key_states = torch.cat((k_rot, k_pass), dim=-1)

        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.rotary_ndims
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), attn_weights


class StableLmMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = StableLmAttention(config, layer_idx)
        self.mlp = StableLmMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class StableLmStack(nn.Module):
    """The model body without embeddings: builds positions, rotary tables and the causal mask."""

    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = StableLmRotaryEmbedding(
            int(head_dim * config.partial_rotary_factor), base=config.rope_theta
        )
        self.layers = nn.ModuleList([StableLmDecoderLayer(config, 0)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        past_seen_tokens = 0
        cache_position = torch.arange(
            past_seen_tokens, past_seen_tokens + seq_len, device=inputs_embeds.device
        )
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=inputs_embeds.device).triu(1)
        mask = torch.zeros(seq_len, seq_len, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        mask = mask.masked_fill(future, torch.finfo(inputs_embeds.dtype).min)[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask=mask, position_embeddings=position_embeddings
            )
        return self.norm(hidden_states)


def make_stablelm():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        partial_rotary_factor=0.25,
        rope_theta=10000,
        qk_layernorm=True,
        use_qkv_bias=True,
        layer_norm_eps=1e-5,
    )
    model = StableLmStack(config)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        attn = model.layers[0].self_attn
        for norm in list(attn.q_layernorm.norms) + list(attn.k_layernorm.norms):
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    return model


EXPECT = {
    "target": "make_stablelm",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "layer": "layers.0.self_attn",
    "style": "HF StableLmAttention/StableLmDecoderLayer (StableLmLayerNormPerHead, partial_rotary_factor=0.25, GQA); scores / math.sqrt(self.rotary_ndims)",
}
