"""Apertus (swiss-ai) style attention: per-head RMS q_norm and k_norm declared, GQA 8
query heads over 2 kv heads, rope_theta 12e6, pre-norm decoder layer; the key path
skips its k_norm (the normalised keys are computed into a variable that is never used).
"""

import torch
import torch.nn.functional as F
from torch import nn


class ApertusRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class ApertusAttention(nn.Module):
    def __init__(self, hidden=64, heads=8, kv=2, head_dim=8):
        super().__init__()
        self.head_dim, self.heads, self.kv = head_dim, heads, kv
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = ApertusRMSNorm(head_dim)
        self.k_norm = ApertusRMSNorm(head_dim)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hs = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hs).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hs).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hs).transpose(1, 2)
        query_states = self.q_norm(query_states)
        key_normed = self.k_norm(key_states)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        out = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=attention_mask,
            scale=self.scaling,
            enable_gqa=True,
        )
        out = out.transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), None


class ApertusDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_layernorm = ApertusRMSNorm(64)
        self.self_attn = ApertusAttention()
        base, dim = 12_000_000.0, 8
        self.register_buffer(
            "inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).double() / dim), persistent=False
        )

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        position_ids = torch.arange(t)[None].expand(b, t)
        freqs = position_ids[..., None].double() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        pe = (emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype))
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
        h, _ = self.self_attn(self.attention_layernorm(hidden_states), pe, mask)
        return hidden_states + h


def make_apertus_layer():
    torch.manual_seed(102)
    layer = ApertusDecoderLayer()
    with torch.no_grad():
        for n in (layer.attention_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm):
            n.weight.copy_(torch.rand(n.weight.shape) * 1.5 + 0.3)
    return layer


EXPECT = {
    "target": "make_apertus_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "HF Apertus (per-head RMS q_norm/k_norm, GQA 8:2, rope 12e6, SDPA enable_gqa): k_norm output stored "
    "in key_normed and never used, so keys are rotated un-normalised",
}
