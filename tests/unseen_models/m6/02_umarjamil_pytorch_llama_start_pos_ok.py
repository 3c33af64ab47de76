"""LLaMA-2 the way Umar Jamil's "pytorch-llama" (model.py) writes it, from memory and in my own
words: `ModelArgs` dataclass, `precompute_theta_pos_frequencies` returning complex `freqs_complex`
(torch.polar), `apply_rotary_embeddings` that views the last dim as (d/2, 2) pairs, turns them into
complex numbers and multiplies (interleaved pairing), `RMSNorm` with `self.weight * self._norm(x)`,
`repeat_kv` (expand + reshape), `SelfAttention` with wq/wk/wv/wo (no bias) and its own preallocated
`self.cache_k` / `self.cache_v` buffers (batch, max_seq_len, n_kv_heads, head_dim), `EncoderBlock`
(attention_norm, attention, ffn_norm, feed_forward SwiGLU w1/w2/w3), `Transformer` with
`tok_embeddings`, `layers`, `norm`, `output`.

The original asserts one token per call; like Meta's reference it is generalised here to a prompt
of any length with a causal mask (zeros for the cached columns, triu −inf for the new ones).
Driving: `model(tokens, start_pos)` writes the new keys/values at `start_pos` and attends to
`cache[:, :start_pos + seq_len]`; `model(tokens)` is the full forward (start_pos 0).  Also:
`model.reset_kv_cache()` then `model(tokens, use_cache=True)` keeps its own position counter.
GQA 4 query heads / 2 kv heads, head_dim 16, 3 layers, rope theta 10000, buffers for batch ≤ 8 and
64 positions.  Returns logits (batch, tokens, vocab) as a tensor.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Umar Jamil pytorch-llama: forward(tokens, start_pos), per-attention cache_k/cache_v (b, s, kv, d), "
    "torch.polar freqs_complex (interleaved), repeat_kv expand, GQA 4/2, SwiGLU w1/w2/w3",
}


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2
    vocab_size: int = 150
    multiple_of: int = 32
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    max_batch_size: int = 8
    max_seq_len: int = 64


def precompute_theta_pos_frequencies(head_dim, seq_len, theta=10000.0):
    assert head_dim % 2 == 0
    theta_numerator = torch.arange(0, head_dim, 2, dtype=torch.float64)
    theta = 1.0 / (theta ** (theta_numerator / head_dim))
    m = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(m, theta)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_embeddings(x, freqs_complex):
    # (B, S, H, D) -> (B, S, H, D/2) complex
    x_complex = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    freqs_complex = freqs_complex.unsqueeze(0).unsqueeze(2)
    x_rotated = x_complex * freqs_complex
    x_out = torch.view_as_real(x_rotated).reshape(*x.shape)
    return x_out.type_as(x)


def repeat_kv(x, n_rep):
    batch_size, seq_len, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(batch_size, seq_len, n_kv_heads, n_rep, head_dim)
        .reshape(batch_size, seq_len, n_kv_heads * n_rep, head_dim)
    )


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        up = x if x.dtype == torch.float64 else x.float()
        return self.weight * self._norm(up).type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_heads_q = args.n_heads
        self.n_rep = self.n_heads_q // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        shape = (args.max_batch_size, args.max_seq_len, self.n_kv_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, start_pos, freqs_complex, mask):
        batch_size, seq_len, _ = x.shape
        xq = self.wq(x).view(batch_size, seq_len, self.n_heads_q, self.head_dim)
        xk = self.wk(x).view(batch_size, seq_len, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(batch_size, seq_len, self.n_kv_heads, self.head_dim)

        xq = apply_rotary_embeddings(xq, freqs_complex)
        xk = apply_rotary_embeddings(xk, freqs_complex)

        if self.cache_k.dtype != x.dtype:
            self.cache_k = self.cache_k.to(x.dtype)
            self.cache_v = self.cache_v.to(x.dtype)
        self.cache_k[:batch_size, start_pos : start_pos + seq_len] = xk
        self.cache_v[:batch_size, start_pos : start_pos + seq_len] = xv

        keys = self.cache_k[:batch_size, : start_pos + seq_len]
        values = self.cache_v[:batch_size, : start_pos + seq_len]
        keys = repeat_kv(keys, self.n_rep)
        values = repeat_kv(values, self.n_rep)

        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)

        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(
            scores if scores.dtype == torch.float64 else scores.float(), dim=-1
        ).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(batch_size, seq_len, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden_dim = int(2 * (4 * args.dim) / 3)
        hidden_dim = args.multiple_of * ((hidden_dim + args.multiple_of - 1) // args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class EncoderBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = SelfAttention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, freqs_complex, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_complex, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([EncoderBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_complex = precompute_theta_pos_frequencies(
            args.dim // args.n_heads, args.max_seq_len * 2
        )
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.layers:
            layer.attention.cache_k.zero_()
            layer.attention.cache_v.zero_()

    def forward(self, tokens, start_pos: Optional[int] = None, use_cache: bool = False):
        batch_size, seq_len = tokens.shape
        if start_pos is None:
            start_pos = self.current_pos if use_cache else 0
        h = self.tok_embeddings(tokens)
        freqs_complex = self.freqs_complex[start_pos : start_pos + seq_len]
        mask = None
        if seq_len > 1:
            mask = torch.full((seq_len, seq_len), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seq_len, start_pos), device=tokens.device), mask]).to(
                h.dtype
            )
        for layer in self.layers:
            h = layer(h, start_pos, freqs_complex, mask)
        if use_cache:
            self.current_pos = start_pos + seq_len
        h = self.norm(h)
        return self.output(h).float() if h.dtype == torch.float32 else self.output(h)


def make_model():
    torch.manual_seed(6102)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
