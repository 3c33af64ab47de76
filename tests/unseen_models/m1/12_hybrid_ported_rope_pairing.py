"""A small Llama-style decoder assembled from two code bases: most layers use the Hugging Face
attention (rotate_half applied with cos/sin tables laid out as cat(freqs, freqs)), while the
layers listed in config.fused_layers use a FusedRopeAttention ported from a Meta-style
code base (fused wqkv, rotation of adjacent pairs).  The model computes the cos/sin tables
once and hands the same tables to every layer.  MHA, 4 heads of 16.  No cache.

Slip: the ported attention rotates adjacent (interleaved) pairs but is fed the half-layout
tables, so the two members of a pair are turned by different angles: not a rotation.
Only layers.1 is fused; layers 0 and 2 are right.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"],
    "kind": "causal-multihead",
    "layer": "layers.1.self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "cache": None,
    "style": "HF Llama + a Meta-style fused layer ported into it; slip: rotate_every_two with the model's "
    "rotate_half-layout cos/sin tables",
}


class Config:
    vocab_size = 100
    hidden_size = 64
    num_heads = 4
    intermediate_size = 176
    num_layers = 3
    max_positions = 128
    rope_theta = 10000.0
    fused_layers = (1,)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        shape = (B, T, self.num_heads, self.head_dim)
        return (
            self.q_proj(x).view(shape).transpose(1, 2),
            self.k_proj(x).view(shape).transpose(1, 2),
            self.v_proj(x).view(shape).transpose(1, 2),
        )

    def rotate(self, q, k, cos, sin):
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, C))


class FusedRopeAttention(Attention):
    """Ported layer: one wqkv matmul, then the complex-style pair rotation."""

    def __init__(self, cfg):
        super().__init__(cfg)
        del self.q_proj, self.k_proj, self.v_proj
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)

    def project(self, x):
        B, T, C = x.shape
        q, k, v = self.wqkv(x).split(C, dim=-1)
        shape = (B, T, self.num_heads, self.head_dim)
        return (
            q.view(shape).transpose(1, 2),
            k.view(shape).transpose(1, 2),
            v.view(shape).transpose(1, 2),
        )

    def rotate(self, q, k, cos, sin):
        return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = (
            FusedRopeAttention(cfg) if layer_idx in cfg.fused_layers else Attention(cfg)
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        gate, up = self.gate_up(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class HybridLlama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        freqs = torch.outer(torch.arange(cfg.max_positions).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        cos, sin = self.cos_cached[:T], self.sin_cached[:T]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def make_model():
    torch.manual_seed(12)
    model = HybridLlama(Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
