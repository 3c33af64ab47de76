"""HRM (sapientinc/HRM, `models/layers.py` and the ACT-v1 reasoning module): `Attention` with one fused
`qkv_proj` (`CastedLinear`, weights cast to the input dtype) viewed as (batch, seq, heads + 2 * kv_heads,
head_dim) and sliced, `RotaryEmbedding` holding full-length cos/sin caches (rotate_half layout, the
model slices them to the sequence), `flash_attn_func(q, k, v, causal=self.causal)` replaced by an
equivalent torch path (SDPA, kv heads repeated by repeat_interleave as flash-attn maps them), `o_proj`;
post-norm blocks with HRM's weightless `rms_norm`, and a `ReasoningModule` that adds the input
injection to the state before its layers.

This file: Differential-Transformer attention grafted on: two softmax maps from the two halves of q/k, subtracted with a learned lambda."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(hidden_states, variance_epsilon):
    variance = hidden_states.square().mean(-1, keepdim=True)
    return hidden_states * torch.rsqrt(variance + variance_epsilon)


def trunc_normal_init_(tensor, std=1.0):
    with torch.no_grad():
        return tensor.normal_(0, std).clamp_(-2 * std, 2 * std)


class CastedLinear(nn.Module):
    def __init__(self, in_features, out_features, bias):
        super().__init__()
        self.weight = nn.Parameter(trunc_normal_init_(torch.empty((out_features, in_features)),
                                                      std=1.0 / (in_features**0.5)))
        self.bias = nn.Parameter(torch.zeros((out_features,))) if bias else None

    def forward(self, input):
        bias = self.bias.to(input.dtype) if self.bias is not None else None
        return F.linear(input, self.weight.to(input.dtype), bias=bias)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    # q, k: [bs, seq_len, num_heads, head_dim]; cos, sin: [seq_len, head_dim]
    orig_dtype = q.dtype
    q = q.to(cos.dtype)
    k = k.to(cos.dtype)
    q_embed = (q * cos.unsqueeze(-2)) + (rotate_half(q) * sin.unsqueeze(-2))
    k_embed = (k * cos.unsqueeze(-2)) + (rotate_half(k) * sin.unsqueeze(-2))
    return q_embed.to(orig_dtype), k_embed.to(orig_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self):
        return self.cos_cached, self.sin_cached


def flash_attn_func(q, k, v, causal=False):
    """torch stand-in for flash_attn_func: (batch, seq, heads, dim) in and out; GQA as flash-attn maps it."""
    n_rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(n_rep, dim=2)
    v = v.repeat_interleave(n_rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, hidden_size, head_dim, num_heads, num_key_value_heads, causal=False):
        super().__init__()
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.output_size = head_dim * num_heads
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.causal = causal
        self.qkv_proj = CastedLinear(self.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim, bias=False)
        self.o_proj = CastedLinear(self.output_size, self.hidden_size, bias=False)

    def forward(self, cos_sin, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        qkv = qkv.view(batch_size, seq_len, self.num_heads + 2 * self.num_key_value_heads, self.head_dim)
        query = qkv[:, :, : self.num_heads]
        key = qkv[:, :, self.num_heads : self.num_heads + self.num_key_value_heads]
        value = qkv[:, :, self.num_heads + self.num_key_value_heads :]
        if cos_sin is not None:
            cos, sin = cos_sin
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        half = self.head_dim // 2
        s1 = torch.matmul(q[..., :half], k[..., :half].transpose(-2, -1)) / math.sqrt(half)
        s2 = torch.matmul(q[..., half:], k[..., half:].transpose(-2, -1)) / math.sqrt(half)
        w = s1.softmax(dim=-1) - 0.6 * s2.softmax(dim=-1)
        attn_output = torch.matmul(w, v).transpose(1, 2)
        attn_output = attn_output.reshape(batch_size, seq_len, self.output_size)
        return self.o_proj(attn_output)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size, expansion):
        super().__init__()
        inter = round(expansion * hidden_size * 2 / 3)
        self.gate_up_proj = CastedLinear(hidden_size, inter * 2, bias=False)
        self.down_proj = CastedLinear(inter, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HierarchicalReasoningModel_ACTV1Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(
            hidden_size=config["hidden_size"],
            head_dim=config["hidden_size"] // config["num_heads"],
            num_heads=config["num_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            causal=config["causal"],
        )
        self.mlp = SwiGLU(config["hidden_size"], config["expansion"])
        self.norm_eps = config["rms_norm_eps"]

    def forward(self, cos_sin, hidden_states):
        # Post Norm
        hidden_states = rms_norm(hidden_states + self.self_attn(cos_sin=cos_sin, hidden_states=hidden_states), variance_epsilon=self.norm_eps)
        hidden_states = rms_norm(hidden_states + self.mlp(hidden_states), variance_epsilon=self.norm_eps)
        return hidden_states


class HierarchicalReasoningModel_ACTV1ReasoningModule(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden_states, input_injection, **kwargs):
        hidden_states = hidden_states + input_injection
        for layer in self.layers:
            hidden_states = layer(hidden_states=hidden_states, **kwargs)
        return hidden_states


class HRMInner(nn.Module):
    """One L-level step: z_L <- L_level(z_L, x) with z_L at its learned initial state."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rotary_emb = RotaryEmbedding(
            dim=config["hidden_size"] // config["num_heads"],
            max_position_embeddings=config["seq_len"],
            base=config["rope_theta"],
        )
        self.L_level = HierarchicalReasoningModel_ACTV1ReasoningModule(
            [HierarchicalReasoningModel_ACTV1Block(config)]
        )
        self.register_buffer("L_init", trunc_normal_init_(torch.empty(config["hidden_size"]), std=1), persistent=False)

    def forward(self, x):
        seq_len = x.shape[1]
        cos, sin = self.rotary_emb()
        cos_sin = (cos[:seq_len].to(x.dtype), sin[:seq_len].to(x.dtype))
        z_L = self.L_init.to(x.dtype).expand_as(x)
        return self.L_level(z_L, x, cos_sin=cos_sin)


def make_hrm_l_level():
    torch.manual_seed(2638)
    config = dict(hidden_size=64, num_heads=4, num_key_value_heads=4, causal=False,
                  expansion=2.0, rms_norm_eps=1e-5, seq_len=64, rope_theta=10000.0)
    return HRMInner(config).eval()


EXPECT = {'target': 'make_hrm_l_level',
 'kind': 'multihead',
 'ok': False,
 'layer': 'L_level.layers.0.self_attn',
 'unsupported': 'differential',
 'style': 'HRM Attention with DIFF-Transformer style differential attention (softmax(q1k1) - '
          'lambda * softmax(q2k2))'}
