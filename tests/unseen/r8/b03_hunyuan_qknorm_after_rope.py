"""HunYuan (dense v1) style attention: per-head RMS query_layernorm / key_layernorm,
GQA 4 query heads over 2 kv heads, rotate_half rotary; the norms are applied after
the rotary embedding instead of before it.
"""

import torch
from torch import nn


class HunYuanRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class HunYuanAttention(nn.Module):
    def __init__(self, hidden=64, heads=4, kv=2, head_dim=16, use_qk_norm=True):
        super().__init__()
        self.head_dim, self.groups = head_dim, heads // kv
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.use_qk_norm = use_qk_norm
        self.query_layernorm = HunYuanRMSNorm(head_dim)
        self.key_layernorm = HunYuanRMSNorm(head_dim)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hs = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hs).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hs).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hs).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.use_qk_norm:
            q = self.query_layernorm(q)
            k = self.key_layernorm(k)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = nn.functional.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), w


class HunYuanDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = HunYuanRMSNorm(64)
        self.self_attn = HunYuanAttention()

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
        freqs = torch.arange(t, dtype=torch.float64)[None, :, None] * inv_freq
        emb = torch.cat((freqs, freqs), -1).expand(b, -1, -1)
        pe = (emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype))
        mask = torch.full(
            (t, t), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype
        ).triu(1)[None, None]
        h, _ = self.self_attn(self.input_layernorm(hidden_states), pe, mask)
        return hidden_states + h


def make_hunyuan_layer():
    torch.manual_seed(103)
    layer = HunYuanDecoderLayer()
    with torch.no_grad():
        for n in (
            layer.input_layernorm,
            layer.self_attn.query_layernorm,
            layer.self_attn.key_layernorm,
        ):
            n.weight.copy_(torch.rand(n.weight.shape) * 1.5 + 0.3)
    return layer


EXPECT = {
    "target": "make_hunyuan_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "HF HunYuan dense v1 layout (per-head RMS query_layernorm/key_layernorm, GQA 4:2): the norms are "
    "applied after apply_rotary_pos_emb, i.e. after the rotation instead of before it",
}
