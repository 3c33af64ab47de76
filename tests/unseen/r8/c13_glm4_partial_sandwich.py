"""GLM-4 (HF Glm4) style decoder layer: q/k/v with bias (attention_bias), o_proj without,
6 query heads over 2 kv heads (groups of 3), partial_rotary_factor 0.5 applied to the
first half of each head with interleaved (adjacent) pairs, sandwich norms
(post_self_attn_layernorm) around attention.
"""

import torch
from torch import nn


class Glm4RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate_half(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


class Glm4RotaryEmbedding(nn.Module):
    def __init__(self, head_dim=16, partial_rotary_factor=0.5, base=10000.0):
        super().__init__()
        dim = int(head_dim * partial_rotary_factor)
        self.register_buffer(
            "inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim)), persistent=False
        )

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Glm4Attention(nn.Module):
    def __init__(self, hidden=96, heads=6, kv=2, head_dim=16):
        super().__init__()
        self.head_dim = head_dim
        self.num_key_value_groups = heads // kv
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=True)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hs = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hs).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hs).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hs).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        b, kvh, t, d = k.shape
        k = k[:, :, None].expand(b, kvh, self.num_key_value_groups, t, d).reshape(b, -1, t, d)
        v = v[:, :, None].expand(b, kvh, self.num_key_value_groups, t, d).reshape(b, -1, t, d)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = nn.functional.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), w


class Glm4DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Glm4Attention()
        self.input_layernorm = Glm4RMSNorm(96)
        self.post_self_attn_layernorm = Glm4RMSNorm(96)
        self.rotary_emb = Glm4RotaryEmbedding()

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        position_ids = torch.arange(t).expand(b, t)
        mask = torch.full((t, t), float("-inf"), dtype=hidden_states.dtype).triu(1)[None, None]
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(h, self.rotary_emb(h, position_ids), mask)
        return residual + self.post_self_attn_layernorm(h)


def make_glm4_layer():
    torch.manual_seed(13)
    layer = Glm4DecoderLayer()
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_self_attn_layernorm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_glm4_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 6,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Glm4: biased q/k/v, GQA 6:2 (groups of 3) via expand/reshape, partial_rotary_factor 0.5 with "
    "repeat_interleaved tables on adjacent pairs, sandwich post_self_attn_layernorm",
}
