"""PhiMoE style attention with a config sliding_window (12): GQA 4 query heads over
2 kv heads, biased q/k/v/o, rope_theta 1e6, the decoder layer builds a causal
sliding-window boolean mask from config.sliding_window and hands it to SDPA.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PhiMoEMiniConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 1e6
    sliding_window: int = 12
    attention_bias: bool = True


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PhiMoEAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.nh, self.nkv = config.num_attention_heads, config.num_key_value_heads
        b = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.nh * self.head_dim, bias=b)
        self.k_proj = nn.Linear(config.hidden_size, self.nkv * self.head_dim, bias=b)
        self.v_proj = nn.Linear(config.hidden_size, self.nkv * self.head_dim, bias=b)
        self.o_proj = nn.Linear(self.nh * self.head_dim, config.hidden_size, bias=b)

    def forward(self, hidden_states, cos, sin, attention_mask):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.nh, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, self.nkv, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, self.nkv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class PhiMoEDecoderLayer(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config or PhiMoEMiniConfig()
        self.input_layernorm = nn.LayerNorm(self.config.hidden_size, eps=1e-5)
        self.self_attn = PhiMoEAttention(self.config)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        hd = self.self_attn.head_dim
        position_ids = torch.arange(t)[None].expand(b, t)
        inv_freq = 1.0 / (
            self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=hidden_states.dtype) / hd)
        )
        freqs = position_ids[..., None].to(hidden_states.dtype) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        q_idx = torch.arange(t)[:, None]
        kv_idx = torch.arange(t)[None, :]
        allowed = (kv_idx <= q_idx) & (q_idx - kv_idx < self.config.sliding_window)
        out = self.self_attn(
            self.input_layernorm(hidden_states), emb.cos(), emb.sin(), allowed[None, None]
        )
        return hidden_states + out


def make_phimoe_layer():
    torch.manual_seed(10)
    layer = PhiMoEDecoderLayer()
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.input_layernorm.bias.uniform_(-0.3, 0.3)
    return layer


EXPECT = {
    "target": "make_phimoe_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": None,
        "window": 12,
        "bias": None,
    },
    "style": "HF PhiMoE: biased q/k/v/o, GQA 4:2 with repeat_interleave, LayerNorm pre-norm, sliding_window 12 "
    "from config turned into a boolean causal-window mask (kv <= q and q - kv < window) for SDPA",
}
