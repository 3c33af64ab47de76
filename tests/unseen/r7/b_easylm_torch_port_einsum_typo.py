"""A torch port of EasyLM's Flax LLaMA block ((b, s, h, d) tensors, complex-number rotary, einsum attention with a
combined causal bias); bug: the score einsum was retyped as 'bqhd,bkhe->bhqk', which sums q and k over their
feature axes separately and multiplies the sums instead of taking the dot product."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LLaMAConfig:
    hidden_size: int = 64
    intermediate_size: int = 172
    num_attention_heads: int = 4
    max_sequence_length: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.kernel = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.square(x).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.kernel


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.complex(torch.cos(freqs), torch.sin(freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    reshape_xq = xq.reshape(*xq.shape[:-1], -1, 2)
    reshape_xk = xk.reshape(*xk.shape[:-1], -1, 2)
    xq_ = torch.complex(reshape_xq[..., 0], reshape_xq[..., 1])
    xk_ = torch.complex(reshape_xk[..., 0], reshape_xk[..., 1])
    freqs_cis = freqs_cis[:, :, None, :]  # (b, s, 1, d/2)
    xq_out = xq_ * freqs_cis
    xq_out = torch.stack((xq_out.real, xq_out.imag), dim=-1).reshape(*xq_out.shape[:-1], -1)
    xk_out = xk_ * freqs_cis
    xk_out = torch.stack((xk_out.real, xk_out.imag), dim=-1).reshape(*xk_out.shape[:-1], -1)
    return xq_out.to(xq.dtype), xk_out.to(xk.dtype)


def make_causal_mask(seq_len, device=None):
    idx = torch.arange(seq_len, device=device)
    return (idx[None, :] <= idx[:, None])[None, None]  # (1, 1, q, k)


class FlaxLLaMAAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.wq = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(
                self.head_dim, config.max_sequence_length * 2, theta=config.rope_theta
            ),
            persistent=False,
        )

    def _split_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.num_heads, self.head_dim))

    def _merge_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.embed_dim,))

    def forward(self, hidden_states, position_ids=None):
        xq, xk, xv = self.wq(hidden_states), self.wk(hidden_states), self.wv(hidden_states)
        xq, xk, xv = self._split_heads(xq), self._split_heads(xk), self._split_heads(xv)
        seq_len = hidden_states.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden_states.device)[None].expand(
                hidden_states.shape[0], -1
            )
        freqs_cis = self.freqs_cis[position_ids]
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        causal_mask = make_causal_mask(seq_len, device=hidden_states.device)
        attention_bias = torch.where(
            causal_mask,
            torch.zeros((), dtype=xq.dtype),
            torch.full((), torch.finfo(xq.dtype).min, dtype=xq.dtype),
        )
        attn_weights = torch.einsum("bqhd,bkhe->bhqk", xq, xk) / math.sqrt(self.head_dim)
        attn_weights = F.softmax(attn_weights + attention_bias, dim=-1)
        attn_output = torch.einsum("bhqk,bkhd->bqhd", attn_weights, xv)
        return self.wo(self._merge_heads(attn_output))


class FlaxLLaMAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FlaxLLaMABlock(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        config = config or LLaMAConfig()
        self.attention = FlaxLLaMAAttention(config)
        self.feed_forward = FlaxLLaMAMLP(config)
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attention(self.attention_norm(hidden_states))
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states))


EXPECT = {
    "target": "FlaxLLaMABlock",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "not_dot_product",
    "layer": "attention",
    "style": "EasyLM FlaxLLaMAAttention/FlaxLLaMABlock ported to torch (wq/wk/wv/wo, _split_heads to (b, s, h, d), complex freqs_cis rotary, make_causal_mask -> where(0, finfo.min) bias, einsum 'bhqk,bkhd->bqhd'); score einsum 'bqhd,bkhe->bhqk'",
}
