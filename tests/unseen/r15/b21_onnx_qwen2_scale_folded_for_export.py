"""Qwen2 decoder rewritten for ONNX export: reshape/permute only (no view/transpose), cos/sin tables
cached to max_position_embeddings and sliced, an explicit Python loop over heads (kv head
h // groups), additive float causal mask built by the model from (1 - tril) * finfo.min.

This file: one bug: self.scaling = 1.0 'folded into q_proj at export', but q_proj was never rescaled."""

import torch
from torch import nn


class Qwen2Config:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 4
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    max_position_embeddings = 128


class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = torch.mean(hidden_states * hidden_states, dim=-1, keepdim=True)
        return self.weight * (hidden_states / torch.sqrt(variance + self.variance_epsilon))


class ExportRotary(nn.Module):
    """cos/sin tables precomputed to max_position_embeddings and sliced: no data-dependent ops."""

    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Qwen2AttentionExport(nn.Module):
    """Qwen2 attention rewritten for ONNX export: reshape/permute only (no view/transpose),
    an explicit Python loop over heads (unrolled at trace time), additive float mask."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = 1.0  # folded into q_proj weights at export time
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, cos, sin, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        q = (
            self.q_proj(hidden_states)
            .reshape(bsz, q_len, self.num_heads, self.head_dim)
            .permute(0, 2, 1, 3)
        )
        k = (
            self.k_proj(hidden_states)
            .reshape(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .permute(0, 2, 1, 3)
        )
        v = (
            self.v_proj(hidden_states)
            .reshape(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .permute(0, 2, 1, 3)
        )

        cos = cos.reshape(1, 1, q_len, self.head_dim)
        sin = sin.reshape(1, 1, q_len, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        heads = []
        for h in range(self.num_heads):
            kv = h // self.num_key_value_groups
            q_h = q[:, h]
            k_h = k[:, kv]
            v_h = v[:, kv]
            scores = torch.matmul(q_h, k_h.permute(0, 2, 1)) * self.scaling
            scores = scores + attention_mask
            probs = torch.softmax(scores, dim=-1)
            heads.append(torch.matmul(probs, v_h))
        attn_output = torch.stack(heads, dim=2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(attn_output)


class Qwen2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayerExport(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen2AttentionExport(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), cos, sin, attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen2ModelExport(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary = ExportRotary(config)
        self.layers = nn.ModuleList([Qwen2DecoderLayerExport(config)])
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        cos, sin = self.rotary(inputs_embeds, seq_len)
        ones = torch.ones(seq_len, seq_len, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        attention_mask = (1.0 - torch.tril(ones)) * torch.finfo(inputs_embeds.dtype).min
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, attention_mask)
        return self.norm(hidden_states)


def make_qwen2_export():
    torch.manual_seed(1542)
    model = Qwen2ModelExport(Qwen2Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Qwen2RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_qwen2_export",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "ONNX-export Qwen2 head loop: self.scaling = 1.0 'folded into q_proj at export', but q_proj was "
    "never rescaled",
}
