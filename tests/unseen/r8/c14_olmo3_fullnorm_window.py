"""Olmo 3 style sliding-window layer: q_norm/k_norm RMSNorms over the full projected
width (heads * head_dim, before the head split), MHA 4 heads, rope_theta 500000,
config sliding_window 16 used on 3 of every 4 layers (this is layer 0: sliding),
norms after the sublayer (OLMo-2/3 reordered post-norm).
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Olmo3MiniConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    rope_theta: float = 500000.0
    sliding_window: int = 16
    rms_norm_eps: float = 1e-6
    layer_types: list = field(
        default_factory=lambda: ["sliding_attention"] * 3 + ["full_attention"]
    )


class Olmo3RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        v = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(v + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Olmo3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, nh * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(nh * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Olmo3RMSNorm(nh * self.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo3RMSNorm(nkv * self.head_dim, config.rms_norm_eps)
        self.scaling = self.head_dim**-0.5
        self.sliding_window = (
            config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        )

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hs = (*input_shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states))
        k = self.k_norm(self.k_proj(hidden_states))
        v = self.v_proj(hidden_states)
        q = q.view(hs).transpose(1, 2)
        k = k.view(hs).transpose(1, 2)
        v = v.view(hs).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = nn.functional.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), w


class Olmo3DecoderLayer(nn.Module):
    def __init__(self, config=None, layer_idx=0):
        super().__init__()
        self.config = config or Olmo3MiniConfig()
        self.self_attn = Olmo3Attention(self.config, layer_idx)
        self.post_attention_layernorm = Olmo3RMSNorm(self.config.hidden_size)

    def _sliding_causal_mask(self, t, dtype):
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        ok = j <= i
        if self.self_attn.sliding_window is not None:
            ok = ok & (j > i - self.self_attn.sliding_window)
        return torch.zeros(t, t, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)[None, None]

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        hd = self.self_attn.head_dim
        inv_freq = 1.0 / (
            self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        )
        pos = torch.arange(t, dtype=torch.float64)[None].expand(b, t)
        freqs = pos[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), -1)
        pe = (emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype))
        h, _ = self.self_attn(hidden_states, pe, self._sliding_causal_mask(t, hidden_states.dtype))
        return hidden_states + self.post_attention_layernorm(h)


def make_olmo3_layer():
    torch.manual_seed(14)
    layer = Olmo3DecoderLayer()
    with torch.no_grad():
        for n in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.post_attention_layernorm):
            n.weight.copy_(torch.rand(n.weight.shape) + 0.3)
    return layer


EXPECT = {
    "target": "make_olmo3_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 500000},
        "qk_norm": "full",
        "window": 16,
        "bias": None,
    },
    "style": "HF Olmo3 sliding layer: full-width RMS q_norm/k_norm on the projections before the head split, "
    "sliding_window 16 from config (j > i - window), rope_theta 500000, OLMo-2/3 post-sublayer norm",
}
