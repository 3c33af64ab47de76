"""ExecuTorch-llama-style export-friendly attention: the static KVCache module is a required forward argument,
input_pos selects rows of a precomputed causal mask and of the cos/sin tables, and SDPA runs over the whole cache
length (multi-query: 4 heads, 1 kv head, interleaved rotary). Correct, but unusable without its cache."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 1
    max_batch_size: int = 2
    max_seq_len: int = 256
    rope_freq_base: float = 10000.0


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    """xq/xk: (bs, seqlen, heads, head_dim); pairs (2i, 2i+1) rotate together."""
    xq_r, xq_i = xq.reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)
    freqs_cos = freqs_cos[None, :, None, :].to(xq.dtype)
    freqs_sin = freqs_sin[None, :, None, :].to(xq.dtype)
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)
    return xq_out, xk_out


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        bsz = k_val.shape[0]
        self.k_cache[:bsz, :, input_pos] = k_val.to(self.k_cache.dtype)
        self.v_cache[:bsz, :, input_pos] = v_val.to(self.v_cache.dtype)
        return self.k_cache[:bsz], self.v_cache[:bsz]


class Attention(nn.Module):
    def __init__(self, args=None):
        super().__init__()
        args = args or ModelArgs()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.max_seq_len = args.max_seq_len
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        causal_mask = torch.tril(torch.ones(self.max_seq_len, self.max_seq_len, dtype=torch.bool))
        self.register_buffer("mask", causal_mask, persistent=False)
        freqs_cos, freqs_sin = precompute_freqs_cis(
            self.head_dim, self.max_seq_len, args.rope_freq_base
        )
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)

    def forward(self, x, kv_cache, input_pos):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, k, self.freqs_cos[input_pos], self.freqs_sin[input_pos])

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        mask = self.mask[input_pos]  # (seqlen, max_seq_len): cache slots past input_pos are hidden
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


EXPECT = {
    "target": "Attention",
    "kind": "causal-multihead",
    "ok": True,
    "unsupported": "kv_cache",
    "style": "ExecuTorch examples/models/llama Attention (forward(x, kv_cache, input_pos) with a static KVCache module argument, mask = self.mask[input_pos] over the full cache, real cos/sin interleaved rotary, MQA repeat_interleave)",
}
