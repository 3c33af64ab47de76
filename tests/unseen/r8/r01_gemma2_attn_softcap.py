"""Gemma 2 style sliding decoder layer WITH attention logit softcapping
(attn_logit_softcapping = 4, smaller than Gemma 2's 50 so that the cap is visible with
random weights; q/k weights are also enlarged): scores -> cap * tanh(scores / cap).
Not textbook attention and no vocabulary stage covers it: should be refused.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Gemma2MiniConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    query_pre_attn_scalar: int = 16
    rope_theta: float = 10000.0
    sliding_window: int = 8
    rms_norm_eps: float = 1e-6
    attn_logit_softcapping: float = 4.0


class Gemma2RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1.0 + self.weight)


class Gemma2Rotary(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(self.inv_freq.dtype) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden, n_rep):
    b, kvh, t, d = hidden.shape
    if n_rep == 1:
        return hidden
    hidden = hidden[:, :, None, :, :].expand(b, kvh, n_rep, t, d)
    return hidden.reshape(b, kvh * n_rep, t, d)


class Gemma2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.groups = self.num_heads // self.num_kv
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.sliding_window = config.sliding_window if layer_idx % 2 == 0 else None
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.groups)
        v = repeat_kv(v, self.groups)
        attn = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.config.attn_logit_softcapping is not None:
            attn = attn / self.config.attn_logit_softcapping
            attn = torch.tanh(attn)
            attn = attn * self.config.attn_logit_softcapping
        if attention_mask is not None:
            attn = attn + attention_mask[:, :, :, : k.shape[-2]]
        attn = nn.functional.softmax(attn, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), attn


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config=None, layer_idx=0):
        super().__init__()
        config = config or Gemma2MiniConfig()
        self.config = config
        self.self_attn = Gemma2Attention(config, layer_idx)
        self.input_layernorm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Gemma2Rotary(config.head_dim, config.rope_theta)

    def _mask(self, x):
        n = x.shape[1]
        minv = torch.finfo(x.dtype).min
        causal = torch.full((n, n), minv, dtype=x.dtype).triu(1)
        if self.self_attn.sliding_window is not None:
            # hide keys that are sliding_window or more tokens behind the query
            far = torch.tril(
                torch.ones(n, n, dtype=torch.bool), diagonal=-self.self_attn.sliding_window
            )
            causal = causal.masked_fill(far, minv)
        return causal[None, None]

    def forward(self, hidden_states):
        cache_position = torch.arange(hidden_states.shape[1])
        position_ids = cache_position.unsqueeze(0).expand(hidden_states.shape[0], -1)
        pos_emb = self.rotary_emb(hidden_states, position_ids)
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(h, pos_emb, self._mask(hidden_states))
        h = self.post_attention_layernorm(h)
        return residual + h


def make_layer():
    torch.manual_seed(0)
    layer = Gemma2DecoderLayer(Gemma2MiniConfig(), layer_idx=0)
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(-0.5, 0.5)
        layer.post_attention_layernorm.weight.uniform_(-0.5, 0.5)
        layer.self_attn.q_proj.weight.mul_(4.0)
        layer.self_attn.k_proj.weight.mul_(4.0)
    return layer


EXPECT = {
    "target": "make_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "unsupported": "softcap",
    "style": "HF Gemma 2 sliding layer with attn_logit_softcapping (tanh soft cap on the scaled scores): a "
    "non-textbook transform outside the vocabulary; the checker should refuse rather than report a mistake",
}
