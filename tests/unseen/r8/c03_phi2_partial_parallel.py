"""Phi-1/Phi-2 style parallel block: one LayerNorm feeds both attention and MLP,
dense projection with bias, partial rotary (partial_rotary_factor 0.5 of a 32-wide
head, rotate_half on the rotated slice), position_ids from the model.
"""

import math

import torch
from torch import nn


class PhiRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.register_buffer(
            "inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False
        )

    def forward(self, x, position_ids):
        freqs = torch.einsum("bt,f->btf", position_ids.to(x.dtype), self.inv_freq.to(x.dtype))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class PhiAttention(nn.Module):
    def __init__(self, hidden_size=128, num_heads=4, partial_rotary_factor=0.5, rope_theta=10000.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.rotary_ndims = int(partial_rotary_factor * self.head_dim)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.dense = nn.Linear(hidden_size, hidden_size, bias=True)
        self.rotary_emb = PhiRotaryEmbedding(self.rotary_ndims, rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rot, q_pass = q[..., : self.rotary_ndims], q[..., self.rotary_ndims :]
        k_rot, k_pass = k[..., : self.rotary_ndims], k[..., self.rotary_ndims :]
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        q = torch.cat((q_rot, q_pass), dim=-1)
        k = torch.cat((k_rot, k_pass), dim=-1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.dense(out)


class PhiDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(128, eps=1e-5)
        self.self_attn = PhiAttention()
        self.mlp = nn.Sequential(
            nn.Linear(128, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 128)
        )

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        position_ids = torch.arange(t).unsqueeze(0).expand(b, t)
        mask = torch.zeros(t, t, dtype=hidden_states.dtype)
        mask = mask.masked_fill(
            torch.triu(torch.ones(t, t, dtype=torch.bool), 1), torch.finfo(hidden_states.dtype).min
        )
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        return residual + self.self_attn(h, mask[None, None], position_ids) + self.mlp(h)


def make_phi_layer():
    torch.manual_seed(2)
    layer = PhiDecoderLayer()
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.input_layernorm.bias.uniform_(-0.2, 0.2)
    return layer


EXPECT = {
    "target": "make_phi_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 32,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Phi-1/Phi-2 parallel decoder layer: q/k/v/dense with bias, partial rotary (rotary_ndims = 16 of 32), "
    "rotate_half on the rotated slice, additive causal mask and position_ids built by the layer",
}
