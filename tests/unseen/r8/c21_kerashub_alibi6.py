"""Torch port of a keras-hub style ALiBi causal attention (AlibiBias layer feeding a
CachedMultiHeadAttention-like layer): 6 heads (not a power of two, so slopes take the
8-head sequence's even entries for the two extra heads), bias -slope * |i - j| added
to the scaled scores, causal mask applied afterwards with masked_fill.
"""

import math

import torch
from torch import nn


def alibi_head_slopes(num_heads):
    def power_of_2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = power_of_2(2 * closest)[0::2][: num_heads - closest]
    return power_of_2(closest) + extra


class AlibiBias(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.register_buffer("slopes", torch.tensor(alibi_head_slopes(num_heads)), persistent=False)

    def forward(self, q_len, k_len, dtype):
        q_pos = torch.arange(q_len)[:, None]
        k_pos = torch.arange(k_len)[None, :]
        distance = (q_pos - k_pos).abs().to(dtype)
        return -self.slopes.to(dtype)[:, None, None] * distance[None]


class AlibiMultiHeadAttention(nn.Module):
    def __init__(self, hidden_dim=96, num_heads=6):
        super().__init__()
        self.num_heads, self.key_dim = num_heads, hidden_dim // num_heads
        self.query_dense = nn.Linear(hidden_dim, hidden_dim)
        self.key_dense = nn.Linear(hidden_dim, hidden_dim)
        self.value_dense = nn.Linear(hidden_dim, hidden_dim)
        self.output_dense = nn.Linear(hidden_dim, hidden_dim)
        self.alibi = AlibiBias(num_heads)

    def forward(self, hidden_states, causal_mask):
        b, t, _ = hidden_states.shape
        split = lambda x: x.view(b, t, self.num_heads, self.key_dim)
        q = split(self.query_dense(hidden_states))
        k = split(self.key_dense(hidden_states))
        v = split(self.value_dense(hidden_states))
        scores = torch.einsum("aecd,abcd->acbe", k, q) / math.sqrt(self.key_dim)  # (b, h, q, k)
        scores = scores + self.alibi(t, t, scores.dtype)[None]
        scores = scores.masked_fill(~causal_mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("acbe,aecd->abcd", probs, v)
        return self.output_dense(out.reshape(b, t, -1))


class AlibiDecoderBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention_layer_norm = nn.LayerNorm(96, eps=1e-5)
        self.self_attention_layer = AlibiMultiHeadAttention()

    def forward(self, x):
        t = x.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        return x + self.self_attention_layer(self.self_attention_layer_norm(x), causal)


def make_alibi_block():
    torch.manual_seed(21)
    blk = AlibiDecoderBlock()
    with torch.no_grad():
        blk.self_attention_layer_norm.weight.uniform_(0.5, 1.5)
    return blk


EXPECT = {
    "target": "make_alibi_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attention_layer",
    "structure": {
        "heads": 6,
        "kv_heads": 6,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "alibi",
    },
    "style": "torch port of keras-hub AlibiBias + MultiHeadAttention einsum layout ('aecd,abcd->acbe'): 6 heads "
    "with the interleaved non-power-of-two slopes, -slope*|i-j| distance form, masked_fill causal mask",
}
