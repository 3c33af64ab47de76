"""Helium (Kyutai) style decoder body with TWO decoder layers (a whole small model,
two attention layers): outside the single-layer round, should be refused (or handled
as a model report).
"""

import torch
from torch import nn


class HeliumRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class HeliumRotaryEmbedding(nn.Module):
    def __init__(self, dim=16, base=100000.0):
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim)), persistent=False
        )

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class HeliumAttention(nn.Module):
    def __init__(self, hidden=64, heads=4, kv=2, head_dim=16):
        super().__init__()
        self.head_dim, self.groups = head_dim, heads // kv
        self.scaling = 1 / (head_dim**0.5)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k = torch.repeat_interleave(k, self.groups, dim=1)
        v = torch.repeat_interleave(v, self.groups, dim=1)
        w = (q @ k.transpose(-2, -1)) * self.scaling + attention_mask
        w = w.softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, t, -1)), w


class HeliumDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = HeliumRMSNorm(64)
        self.self_attn = HeliumAttention()

    def forward(self, x, pe, mask):
        return x + self.self_attn(self.input_layernorm(x), pe, mask)[0]


class HeliumModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([HeliumDecoderLayer() for _ in range(2)])
        self.rotary_emb = HeliumRotaryEmbedding()
        self.norm = HeliumRMSNorm(64)

    def forward(self, inputs_embeds):
        b, t, _ = inputs_embeds.shape
        attention_mask = torch.ones(b, t, dtype=torch.long)
        position_ids = attention_mask.cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        keep = (
            torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
            & attention_mask[:, None, None, :].bool()
        )
        additive = torch.zeros(keep.shape, dtype=inputs_embeds.dtype).masked_fill(
            ~keep, float("-inf")
        )
        pe = self.rotary_emb(inputs_embeds, position_ids)
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, pe, additive)
        return self.norm(h)


def make_helium():
    torch.manual_seed(12)
    m = HeliumModel()
    with torch.no_grad():
        for layer in m.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
        m.norm.weight.uniform_(0.5, 1.5)
    return m


EXPECT = {
    "target": "make_helium",
    "kind": "causal-multihead",
    "ok": True,
    "unsupported": "model",
    "style": "HF Helium decoder body with two layers (layers.0.self_attn, layers.1.self_attn), both correct; a whole "
    "model, which this round expects to be refused (a model report would also be acceptable)",
}
