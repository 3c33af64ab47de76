"""Stable-audio-tools Attention with the per-head LayerNorm qk_norm moved after the partial rotary (LayerNorm with gains/bias does not commute with it)."""

import torch
import torch.nn.functional as F
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward_from_seq_len(self, seq_len):
        t = torch.arange(seq_len, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def rotate_half(x):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    rot_dim, seq_len = freqs.shape[-1], t.shape[-2]
    freqs = freqs[-seq_len:, :].to(t.dtype)
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos()) + (rotate_half(t) * freqs.sin())
    return torch.cat((t, t_unrotated), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, dim_heads=16, causal=False, qk_norm="ln"):
        super().__init__()
        self.dim = dim
        self.dim_heads = dim_heads
        self.num_heads = dim // dim_heads
        self.causal = causal
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.qk_norm = qk_norm
        if self.qk_norm == "ln":
            self.q_norm = nn.LayerNorm(dim_heads, elementwise_affine=True, eps=1.0e-6)
            self.k_norm = nn.LayerNorm(dim_heads, elementwise_affine=True, eps=1.0e-6)

    def forward(self, x, rotary_pos_emb=None):
        b, n, _ = x.shape
        h = self.num_heads
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, h, self.dim_heads).transpose(1, 2) for t in (q, k, v))
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)
        if self.qk_norm == "ln":
            q = self.q_norm(q)
            k = self.k_norm(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        out = out.transpose(1, 2).reshape(b, n, h * self.dim_heads)
        return self.to_out(out)


class TransformerBlock(nn.Module):
    def __init__(self, dim=80, dim_heads=16):
        super().__init__()
        self.pre_norm = nn.LayerNorm(dim)
        self.self_attn = Attention(dim, dim_heads=dim_heads, causal=False, qk_norm="ln")
        self.rotary_pos_emb = RotaryEmbedding(max(dim_heads // 2, 8))

    def forward(self, x):
        rotary = self.rotary_pos_emb.forward_from_seq_len(x.shape[1])
        return x + self.self_attn(self.pre_norm(x), rotary_pos_emb=rotary)


def make_stable_audio_block():
    torch.manual_seed(1009)
    block = TransformerBlock()
    with torch.no_grad():
        for ln in (block.pre_norm, block.self_attn.q_norm, block.self_attn.k_norm):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_stable_audio_block",
    "kind": "multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "stable-audio-tools Attention with the per-head LayerNorm qk_norm moved after the partial "
    "rotary (LayerNorm with gains/bias does not commute with it)",
}
