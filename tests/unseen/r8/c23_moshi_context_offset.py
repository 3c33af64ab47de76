"""Moshi (Kyutai) style streaming transformer layer, non-streaming call: fused in_proj
(no bias) split with rearrange '(p h d)', interleaved rotary as complex pairs
(max_period 10000), causal attention limited to a context of 10 steps built from
position deltas.  The transformer keeps a streaming offset that starts at 4 (four
conditioning steps consumed earlier), so queries and keys are all rotated at
positions 4..n+3: a uniform shift, which changes no score.
"""

import math

import torch
from einops import rearrange
from torch import nn


def apply_rope(q, k, offset, max_period=10_000.0):
    B, H, T, D = q.shape
    ds = torch.arange(D // 2, dtype=torch.float64)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    ts = (offset + torch.arange(T, dtype=torch.float64)).view(-1, 1)
    rot = torch.polar(torch.ones_like(freqs * ts), freqs * ts)
    qc = torch.view_as_complex(q.double().reshape(B, H, T, D // 2, 2).contiguous()) * rot
    kc = torch.view_as_complex(k.double().reshape(B, H, T, D // 2, 2).contiguous()) * rot
    return torch.view_as_real(qc).flatten(-2).to(q.dtype), torch.view_as_real(kc).flatten(-2).to(
        k.dtype
    )


class StreamingMultiheadAttention(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4, context=10):
        super().__init__()
        self.embed_dim, self.num_heads, self.context = embed_dim, num_heads, context
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, query, offset):
        T = query.shape[1]
        q, k, v = rearrange(self.in_proj(query), "b t (p h d) -> p b h t d", p=3, h=self.num_heads)
        q, k = apply_rope(q, k, offset)
        pos_k = offset + torch.arange(T)
        pos_q = offset + torch.arange(T)
        delta = pos_q[:, None] - pos_k[None, :]
        attn_bias = (pos_k[None, :] >= 0) & (delta >= 0)
        if self.context is not None:
            attn_bias = attn_bias & (delta < self.context)
        x = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        return self.out_proj(rearrange(x, "b h t d -> b t (h d)"))


class StreamingTransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(64, eps=1e-5)
        self.self_attn = StreamingMultiheadAttention()
        self.register_buffer("offset", torch.tensor(4), persistent=False)

    def forward(self, x):
        return x + self.self_attn(self.norm1(x), int(self.offset))


def make_moshi_layer():
    torch.manual_seed(23)
    layer = StreamingTransformerLayer()
    with torch.no_grad():
        layer.norm1.weight.uniform_(0.5, 1.5)
        layer.norm1.bias.uniform_(-0.2, 0.2)
    return layer


EXPECT = {
    "target": "make_moshi_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": 10,
        "bias": None,
    },
    "style": "Moshi StreamingMultiheadAttention (fused in_proj '(p h d)', complex-pair rope max_period 10000, "
    "context 10 as a causal window from position deltas, SDPA bool mask); streaming offset 4 shifts all "
    "positions uniformly (not a mistake)",
}
