"""Seed-OSS (ByteDance) style attention: q/k/v with bias, o_proj without, GQA 8 query
heads over 4 kv heads, rope_theta 1e7; apply_rotary_pos_emb computes k_embed but
returns the un-rotated k, so only the queries carry positions.
"""

import torch
from torch import nn


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k


class SeedOssRotaryEmbedding(nn.Module):
    def __init__(self, dim=8, base=10_000_000.0):
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim)), persistent=False
        )

    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].double()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class SeedOssAttention(nn.Module):
    def __init__(self, hidden=64, heads=8, kv=4, head_dim=8):
        super().__init__()
        self.head_dim, self.groups = head_dim, heads // kv
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
        k = k[:, :, None].expand(b, kvh, self.groups, t, d).reshape(b, -1, t, d)
        v = v[:, :, None].expand(b, kvh, self.groups, t, d).reshape(b, -1, t, d)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = nn.functional.softmax(w, dim=-1)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)), w


class SeedOssModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.ModuleDict(
                    {"input_layernorm": nn.RMSNorm(64, eps=1e-6), "self_attn": SeedOssAttention()}
                )
            ]
        )
        self.rotary_emb = SeedOssRotaryEmbedding()

    def forward(self, inputs_embeds):
        b, t, _ = inputs_embeds.shape
        cache_position = torch.arange(t)
        position_ids = cache_position.unsqueeze(0).expand(b, -1)
        mask = torch.zeros(t, t, dtype=inputs_embeds.dtype).masked_fill(
            cache_position[None, :] > cache_position[:, None], torch.finfo(inputs_embeds.dtype).min
        )[None, None]
        pe = self.rotary_emb(inputs_embeds, position_ids)
        h = inputs_embeds
        for layer in self.layers:
            a, _ = layer["self_attn"](layer["input_layernorm"](h), pe, mask)
            h = h + a
        return h


def make_seed_oss():
    torch.manual_seed(104)
    m = SeedOssModel()
    with torch.no_grad():
        m.layers[0]["input_layernorm"].weight.uniform_(0.5, 1.5)
    return m


EXPECT = {
    "target": "make_seed_oss",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "rotated_keys",
    "mistake": "rope_missing",
    "style": "HF Seed-OSS (biased q/k/v, GQA 8:4, rope 1e7, model builds cos/sin and mask): apply_rotary_pos_emb "
    "returns (q_embed, k), so keys are never rotated",
}
