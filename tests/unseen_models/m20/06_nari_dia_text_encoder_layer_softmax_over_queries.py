"""Nari Labs Dia, text encoder half (transformers' modeling_dia.py DiaEncoder), over byte-token ids.

DiaEncoder: `embedding`, `rotary_emb`, `layers.N` (DiaEncoderLayer: `pre_sa_norm`, `self_attention`,
`post_sa_norm`, `mlp` with fused `gate_up_proj` and `down_proj`), `norm`.  DiaSelfAttention: q/k/v/o
without bias, MHA 4 heads of 16 (num_key_value_groups 1), rotary by halves from an `inv_freq`-style
table with base 1e4 at positions arange(t), bidirectional (is_causal False, no mask for an unpadded
batch), eager matmul * scaling and softmax.  The model returns the encoder's last hidden state
(b, t, 64); there is no decoder and no cache.
Slip: layer 2 is a `DiaSelfAttention` subclass kept from an export experiment that takes the softmax
over dim=-2 (over the queries) instead of over the keys.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.self_attention", "layers.1.self_attention", "layers.2.self_attention"],
    "kind": "multihead",
    "cache": None,
    "layer": "layers.2.self_attention",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "modeling_dia.py DiaEncoder (text side): pre_sa_norm/post_sa_norm, bidirectional rotary-halves self-"
    "attention base 1e4, fused gate_up_proj; layer 2 softmaxes over dim=-2",
}


class DiaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class DiaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class DiaSelfAttention(nn.Module):
    softmax_dim = -1

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings):
        b, t, _ = hidden_states.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = F.softmax(w, dim=self.softmax_dim)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class DiaExportSelfAttention(DiaSelfAttention):
    softmax_dim = -2


class DiaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class DiaEncoderLayer(nn.Module):
    def __init__(self, config, attn_cls):
        super().__init__()
        self.pre_sa_norm = DiaRMSNorm(config.hidden_size, config.norm_eps)
        self.self_attention = attn_cls(config)
        self.post_sa_norm = DiaRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = DiaMLP(config)

    def forward(self, h, position_embeddings):
        h = h + self.self_attention(self.pre_sa_norm(h), position_embeddings)
        return h + self.mlp(self.post_sa_norm(h))


class DiaEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            DiaEncoderLayer(config, DiaExportSelfAttention if i in config.export_layers else DiaSelfAttention)
            for i in range(config.num_hidden_layers)
        ])
        self.norm = DiaRMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = DiaRotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids):
        h = self.embedding(input_ids)
        position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)[None]
        pe = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, pe)
        return self.norm(h)


def make_model():
    torch.manual_seed(2006)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, head_dim=16, rope_theta=10000.0, norm_eps=1e-5,
                             export_layers=(2,))
    model = DiaEncoder(config)
    g = torch.Generator().manual_seed(20061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DiaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
