"""A tiny DeciLM-style decoder: every layer has its own number of key/value heads
(block_configs[i].n_heads_in_group, as in Deci's variable-GQA configs): layer 0 is full
multi-head (8 kv heads), layer 1 groups 4 query heads per kv head (2 kv heads), layer 2 is
multi-query (1 kv head).  Llama-style otherwise: RMSNorm, rotate-half RoPE, SwiGLU.  The kv
heads are expanded with einops.  No cache.

Slip: the expansion pattern is 'b h t d -> b (r h) t d', which tiles the kv heads
(query head i uses kv head i % kv_heads) instead of 'b h t d -> b (h r) t d' (i // group).
It changes nothing with 8 kv heads or with 1, so only layers.1 (2 kv heads) is wrong.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "layer": "layers.1.attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "cache": None,
    "style": "DeciLM variable GQA (per-layer n_heads_in_group) with einops; slip: repeat pattern "
    "'(r h)' instead of '(h r)' pairs query head i with kv head i % kv_heads",
}


@dataclass
class BlockConfig:
    n_heads_in_group: int


@dataclass
class DeciConfig:
    vocab_size: int = 180
    dim: int = 64
    n_heads: int = 8
    ffn_dim: int = 160
    max_seq_len: int = 96
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    block_configs: tuple = (BlockConfig(1), BlockConfig(4), BlockConfig(8))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope_cache(head_dim, max_seq_len, theta):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ang = torch.outer(torch.arange(max_seq_len).float(), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    T = x.shape[-2]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:T] + torch.cat([-x2, x1], dim=-1) * sin[:T]


class VariableGQA(nn.Module):
    def __init__(self, cfg, block_cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_heads_in_group = block_cfg.n_heads_in_group
        self.n_kv_heads = cfg.n_heads // block_cfg.n_heads_in_group
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        T = x.shape[1]
        q = rearrange(self.q_proj(x), "b t (h d) -> b h t d", h=self.n_heads)
        k = rearrange(self.k_proj(x), "b t (h d) -> b h t d", h=self.n_kv_heads)
        v = rearrange(self.v_proj(x), "b t (h d) -> b h t d", h=self.n_kv_heads)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k = repeat(k, "b h t d -> b (r h) t d", r=self.n_heads_in_group)
        v = repeat(v, "b h t d -> b (r h) t d", r=self.n_heads_in_group)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        return self.o_proj(rearrange(out, "b h t d -> b t (h d)"))


class Block(nn.Module):
    def __init__(self, cfg, block_cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = VariableGQA(cfg, block_cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class DeciLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg, bc) for bc in cfg.block_configs])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_cache(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.lm_head(self.norm(x))


def make_model():
    torch.manual_seed(11)
    model = DeciLM(DeciConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
