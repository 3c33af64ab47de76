"""ERNIE 4.5 style attention ported by hand: the rotary tables are laid out for
interleaved (adjacent) pairs, cos/sin repeat_interleave'd as in the HF Ernie4_5 code,
but the port reused a Llama rotate_half that swaps the two halves, so tables and
rotation disagree; GQA 4 query heads over 2 kv heads, rope_theta 500000.
"""

import torch
from torch import nn


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    # Ernie 4.5 keeps the interleaved layout: (c0, c0, c1, c1, ...)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


class Ernie4_5RotaryEmbedding(nn.Module):
    def __init__(self, dim=16, base=500000.0):
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).double() / dim), persistent=False
        )

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Ernie4_5Attention(nn.Module):
    def __init__(self, hidden=64, heads=4, kv=2, head_dim=16):
        super().__init__()
        self.head_dim, self.groups = head_dim, heads // kv
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hs = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hs).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hs).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hs).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        q, k = q.to(v.dtype), k.to(v.dtype)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=self.scaling, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(*input_shape, -1)), None


class Ernie4_5DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(64, eps=1e-5)
        self.self_attn = Ernie4_5Attention()
        self.rotary_emb = Ernie4_5RotaryEmbedding()

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        position_ids = torch.arange(t)[None].expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        h, _ = self.self_attn(
            self.input_layernorm(hidden_states), self.rotary_emb(hidden_states, position_ids), mask
        )
        return hidden_states + h


def make_ernie_layer():
    torch.manual_seed(105)
    layer = Ernie4_5DecoderLayer()
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_ernie_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "style": "HF Ernie 4.5 (GQA 4:2, rope 500000): cos/sin repeat_interleave'd for adjacent pairs but rotated with "
    "the halves-swapping rotate_half, which is not a rotation",
}
