"""MLC-LLM style (mlc_llm/model/<arch>/<arch>_model.py) ported from Relax nn.Module to torch: one fused
qkv_proj, reshape to (b, s, h_q + 2 * h_kv, d), and an attention_with_fused_qkv step standing in for
PagedKVCache's kernel: it splits q/k/v, applies rope in place per rope_mode (NORMAL = llama halves) over
the first rotary_dim channels, builds the causal (and sliding_window_size) mask from positions, and
uses sm_scale. The wrapper mirrors <Arch>ForCausalLM.batch_forward on input embeddings.

This file: one bug: the sliding_window_size is carried to the kernel but its mask branch is disabled: plain causal"""

import math

import torch
from torch import nn


class Config:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 1000000.0
    partial_rotary_factor = 1.0
    sliding_window_size = 6
    qkv_bias = False
    layer_norm_eps = 1e-5


def rope_tables(positions, rotary_dim, theta, dtype):
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    f = positions.to(torch.float64)[:, None] * inv[None, :]
    f = torch.cat([f, f], dim=-1)  # NORMAL layout: [f0..f_{r/2-1}, f0..f_{r/2-1}]
    return f.cos().to(dtype), f.sin().to(dtype)


def apply_rope(x, cos, sin, rotary_dim):
    rot, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    other = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + other * sin, keep], dim=-1)


def attention_with_fused_qkv(qkv, num_q, num_kv, head_dim, sm_scale, rotary_dim, theta, window):
    b, s, _, d = qkv.shape
    q, k, v = torch.split(qkv, [num_q, num_kv, num_kv], dim=2)
    positions = torch.arange(s, device=qkv.device)
    cos, sin = rope_tables(positions, rotary_dim, theta, qkv.dtype)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    q = apply_rope(q, cos, sin, rotary_dim)
    k = apply_rope(k, cos, sin, rotary_dim)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    group = num_q // num_kv
    q = q.reshape(b, num_kv, group, s, d)
    logits = torch.einsum("bkgqd,bksd->bkgqs", q, k) * sm_scale
    qpos, kpos = positions[:, None], positions[None, :]
    allowed = kpos <= qpos
    if False and window is not None:
        allowed = allowed & (qpos - kpos < window)
    logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bkgqs,bksd->bkgqd", probs, v)
    return out.reshape(b, num_q, s, d).transpose(1, 2).reshape(b, s, num_q * d)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = int(config.partial_rotary_factor * self.head_dim)
        self.rope_theta = config.rope_theta
        self.sliding_window_size = config.sliding_window_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.num_q_heads * self.head_dim, config.hidden_size, bias=config.qkv_bias)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        h_q, h_kv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states).reshape(b, s, h_q + 2 * h_kv, d)
        out = attention_with_fused_qkv(
            qkv, h_q, h_kv, d, d**-0.5, self.rotary_dim, self.rope_theta, self.sliding_window_size
        )
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)

    def forward(self, hidden_states):
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states))


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config)])

    def forward(self, inputs_embeds):
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h)
        return h


def make_mlc_mistral():
    torch.manual_seed(2015)
    model = Model(Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.6, 1.4)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_mlc_mistral',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'masked_scores',
 'mistake': 'window_missing',
 'style': 'MLC-LLM fused-qkv Attention with attention_with_fused_qkv: one bug: the '
          'sliding_window_size is carried to the kernel but its mask branch is disabled: plain '
          'causal'}
