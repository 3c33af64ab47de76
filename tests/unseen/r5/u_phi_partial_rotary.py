"""Phi-style attention: q_proj/k_proj/v_proj/dense with biases, partial rotary (factor 0.5, rotate_half), causal mask built in the layer."""

from types import SimpleNamespace

import torch
from torch import nn


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class PhiRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class PhiAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.dense = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=True)
        self.rotary_emb = PhiRotaryEmbedding(self.rotary_ndims, base=config.rope_theta)

    def forward(self, hidden_states, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        if position_ids is None:
            position_ids = torch.arange(q_len, device=hidden_states.device)[None].expand(bsz, q_len)

        q = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        v = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )

        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        q_rot, q_pass = q[..., : self.rotary_ndims], q[..., self.rotary_ndims :]
        k_rot, k_pass = k[..., : self.rotary_ndims], k[..., self.rotary_ndims :]
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        q = torch.cat((q_rot, q_pass), dim=-1)
        k = torch.cat((k_rot, k_pass), dim=-1)

        attn_weights = torch.matmul(q.float(), k.float().transpose(2, 3)) / self.head_dim**0.5
        causal = torch.full((q_len, q_len), torch.finfo(attn_weights.dtype).min).triu(1)
        attn_weights = attn_weights + causal
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(v.dtype)
        attn_output = (
            torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        )
        return self.dense(attn_output), attn_weights


def make_attention():
    config = SimpleNamespace(
        hidden_size=32, num_attention_heads=4, partial_rotary_factor=0.5, rope_theta=10000.0
    )
    return PhiAttention(config)


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "unsupported": "rotary",
    "style": "Phi attention (partial_rotary_factor=0.5, rotate_half on the first half of each head, dense out)",
}
