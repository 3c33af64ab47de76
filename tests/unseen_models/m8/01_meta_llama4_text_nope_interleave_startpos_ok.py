"""Llama 4 text decoder, written the way Meta's llama-models reference (models/llama4/model.py) is.

Transformer: tok_embeddings, layers.N (TransformerBlock: attention_norm, attention, ffn_norm,
feed_forward), norm, output.  Attention has wq/wk/wv/wo (no bias), GQA 4/2, its own preallocated
cache_k/cache_v in (max_batch, max_seq, kv_heads, head_dim), and a per-layer `use_rope` flag: every
`nope_layer_interval`-th layer (here layer 3 of 4) is a NoPE layer (no rotary at all).  Rotary layers
use complex freqs_cis (interleaved pairs, theta 5e5).  The Llama 4 options that leave textbook
attention (L2-norm QK on rotary layers, attention temperature tuning on NoPE layers, chunked local
attention) are switched off in ModelArgs, as the 'use_qk_norm=False' checkpoints ship them.
Cache: Meta style forward(tokens, start_pos), or use_cache=True with the model's own position
counter (reset_kv_cache()); model(tokens) alone is a plain causal forward that touches no cache.
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
    "layers": [
        "layers.0.attention",
        "layers.1.attention",
        "layers.2.attention",
        "layers.3.attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 500000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Meta llama-models Llama 4 text: forward(tokens, start_pos) or use_cache, wq/wk/wv/wo, per-attention "
    "cache_k/cache_v (b, s, kv, d), complex freqs_cis theta 5e5, GQA 4/2, layer 3 a NoPE layer (use_rope False)",
}


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 170
    ffn_dim: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_batch_size: int = 4
    max_seq_len: int = 64
    nope_layer_interval: int = 4
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    attention_chunk_size: Optional[int] = None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        half = x.dtype in (torch.float16, torch.bfloat16)
        return self._norm(x.float() if half else x).type_as(x) * self.weight


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2).contiguous())
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2).contiguous())
    fc = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, use_rope: bool):
        super().__init__()
        self.use_rope = use_rope
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        shape = (args.max_batch_size, args.max_seq_len, self.n_kv_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, start_pos: Optional[int], freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.use_rope:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if start_pos is not None:
            self.cache_k = self.cache_k.to(xq)
            self.cache_v = self.cache_v.to(xq)
            self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
            self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
            xk = self.cache_k[:bsz, : start_pos + seqlen]
            xv = self.cache_v[:bsz, : start_pos + seqlen]
        xq, xk, xv = [t.transpose(1, 2) for t in (xq, xk, xv)]
        xk = xk.repeat_interleave(self.n_rep, dim=1)
        xv = xv.repeat_interleave(self.n_rep, dim=1)
        attn_output = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=mask, dropout_p=0.0)
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(attn_output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.is_nope_layer = (layer_id + 1) % args.nope_layer_interval == 0
        self.attention = Attention(args, use_rope=not self.is_nope_layer)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(i, args) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # a plain attribute, as in Meta's reference (not a buffer: Module.to(dtype) would cast it to real)
        self.freqs_cis = precompute_freqs_cis(
            args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta
        )
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.layers:
            layer.attention.cache_k.zero_()
            layer.attention.cache_v.zero_()

    def forward(self, tokens, start_pos: Optional[int] = None, use_cache: bool = False):
        bsz, seqlen = tokens.shape
        if start_pos is None and use_cache:
            start_pos = self.current_pos
        offset = 0 if start_pos is None else start_pos
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[offset : offset + seqlen]
        total = offset + seqlen
        # boolean mask, True = may attend; rows are the new tokens, columns all keys held
        mask = torch.ones(seqlen, total, dtype=torch.bool, device=tokens.device).tril(
            diagonal=offset
        )
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        if start_pos is not None:
            self.current_pos = start_pos + seqlen
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(801)
    model = Transformer(ModelArgs())
    g = torch.Generator().manual_seed(8011)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()
