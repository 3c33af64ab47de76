"""Moshi (Kyutai) style streaming transformer attention, non-streaming path: one fused
in_proj (no bias) split with rearrange '(p h d)', interleaved rotary (max_period
10000, pairs of adjacent features) and a causal context window of 10 steps.  The
context mask was written with `delta > 0` instead of `delta >= 0`, so every query
loses its own key (the first token then sees nothing but masked values).
"""

import math

import torch
from einops import rearrange
from torch import nn


def apply_rope(q, k, offset, max_period=10_000.0):
    # q, k: (B, H, T, D); rotate adjacent pairs as complex numbers
    B, H, T, D = q.shape
    ds = torch.arange(D // 2, dtype=torch.float64)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    ts = (offset + torch.arange(T, dtype=torch.float64)).view(-1, 1)
    rotr = torch.cos(freqs * ts).to(q.dtype)
    roti = torch.sin(freqs * ts).to(q.dtype)
    q = q.view(B, H, T, D // 2, 2)
    k = k.view(B, H, T, D // 2, 2)
    qr, qi = q[..., 0], q[..., 1]
    kr, ki = k[..., 0], k[..., 1]
    qo = torch.stack([qr * rotr - qi * roti, qr * roti + qi * rotr], dim=-1)
    ko = torch.stack([kr * rotr - ki * roti, kr * roti + ki * rotr], dim=-1)
    return qo.view(B, H, T, D), ko.view(B, H, T, D)


class StreamingMultiheadAttention(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4, context=10, causal=True):
        super().__init__()
        self.embed_dim, self.num_heads, self.context, self.causal = (
            embed_dim,
            num_heads,
            context,
            causal,
        )
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, query):
        T = query.shape[1]
        offset = 0
        projected = self.in_proj(query)
        q, k, v = rearrange(projected, "b t (p h d) -> p b h t d", p=3, h=self.num_heads)
        q, k = apply_rope(q, k, offset)
        pos_k = torch.arange(T)
        pos_q = offset + torch.arange(T)
        delta = pos_q[:, None] - pos_k[None, :]
        attn_bias = (pos_k[None, :] >= 0) & (delta > 0)
        if self.context is not None:
            attn_bias = attn_bias & (delta < self.context)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~attn_bias, torch.finfo(scores.dtype).min)
        x = torch.matmul(torch.softmax(scores, dim=-1), v)
        x = rearrange(x, "b h t d -> b t (h d)")
        return self.out_proj(x)


class StreamingTransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(64, eps=1e-5)
        self.self_attn = StreamingMultiheadAttention()

    def forward(self, x):
        return x + self.self_attn(self.norm1(x))


def make_moshi_layer():
    torch.manual_seed(118)
    layer = StreamingTransformerLayer()
    with torch.no_grad():
        layer.norm1.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_moshi_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "style": "Moshi StreamingMultiheadAttention (fused in_proj '(p h d)', interleaved rope max_period 10000, context "
    "window 10), eager path: delta > 0 hides each query's own key inside the window",
}
