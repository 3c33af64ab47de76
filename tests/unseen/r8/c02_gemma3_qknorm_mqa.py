"""Gemma 3 style global attention layer: multi-query (4 query heads, 1 kv head),
per-head q_norm / k_norm RMSNorms with Gemma's (1 + weight) gain applied before
the rotation, rope_theta 1e6 for global layers, rotary tables built by the model.
"""

import torch
from torch import nn


class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * (1.0 + self.weight)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Gemma3Attention(nn.Module):
    def __init__(self, hidden=64, heads=4, kv_heads=1, head_dim=16, eps=1e-6):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling = head_dim**-0.5  # query_pre_attn_scalar == head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = Gemma3RMSNorm(head_dim, eps)
        self.k_norm = Gemma3RMSNorm(head_dim, eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = self.q_norm(q)
        k = self.k_norm(k)
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=self.scaling, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(b, t, -1).contiguous()
        return self.o_proj(out), None


class Gemma3RotaryEmbedding(nn.Module):
    def __init__(self, head_dim=16, base=1_000_000.0):
        super().__init__()
        self.register_buffer(
            "inv_freq",
            1.0 / base ** (torch.arange(0, head_dim, 2).double() / head_dim),
            persistent=False,
        )

    def forward(self, x, position_ids):
        f = (position_ids[..., None].double() * self.inv_freq).to(x.dtype)
        emb = torch.cat([f, f], dim=-1)
        return emb.cos(), emb.sin()


class Gemma3GlobalBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = Gemma3RMSNorm(64)
        self.self_attn = Gemma3Attention()
        self.post_attention_layernorm = Gemma3RMSNorm(64)
        self.rotary_emb_global = Gemma3RotaryEmbedding()

    def forward(self, x):
        b, t, _ = x.shape
        cache_position = torch.arange(t)
        position_ids = cache_position[None].repeat(b, 1)
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        h, _ = self.self_attn(
            self.input_layernorm(x), self.rotary_emb_global(x, position_ids), causal
        )
        return x + self.post_attention_layernorm(h)


def make_block():
    torch.manual_seed(1)
    blk = Gemma3GlobalBlock()
    with torch.no_grad():
        for n in (
            blk.input_layernorm,
            blk.post_attention_layernorm,
            blk.self_attn.q_norm,
            blk.self_attn.k_norm,
        ):
            n.weight.copy_(torch.rand_like(n.weight) * 1.5 - 0.4)
    return blk


EXPECT = {
    "target": "make_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "HF Gemma 3 global layer: MQA, per-head RMS q_norm/k_norm with (1+w) gain before rotary, "
    "rope_theta 1e6, SDPA with enable_gqa and a boolean causal mask built by the block",
}
