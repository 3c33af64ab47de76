"""Meta Lingua's BaseTransformer (facebookresearch/lingua, lingua/transformer.py) with a Meta-style
start_pos KV cache added for generation.

Lingua pieces kept: `RotaryEmbedding` owned by the model (`rope_embeddings`) whose `freqs_cis`
buffer holds one 2x2 rotation matrix per (position, frequency) pair, shape (S, hd/2, 2, 2), applied
by `apply_rotary_emb` as (x reshaped (..., hd/2, 1, 2) * freqs_cis).sum(-1), i.e. adjacent pairs
(x[2i], x[2i+1]); `Attention` with wq/wk/wv/wo (no bias), `repeat_kv` on dim 2, GQA 4/2, rope theta
1e4; `TransformerBlock` (attention_norm, attention, ffn_norm, feed_forward w1/w2/w3); `LMTransformer`
(tok_embeddings, layers, norm, output).  RMSNorm computes in the input's dtype.
Cache: each Attention owns cache_k/cache_v (max_batch 4, 64, kv_heads, hd).  Meta style:
`model(tokens, start_pos)`, or `model(tokens, use_cache=True)` with the model's `current_pos` and
`reset_kv_cache()`; `model(tokens)` alone is the plain causal forward (no cache touched).
Slip: after writing the new keys at [start_pos, start_pos + seqlen) the layer reads them back with
the same slice, `cache_k[:bsz, start_pos : start_pos + seqlen]`, instead of `[:bsz, : start_pos +
seqlen]`.  A prompt at start_pos 0 is unaffected; every decoded token then attends to itself only.
Positions (freqs_cis rows) are right.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "layers.0.attention"},
    "style": "Meta Lingua BaseTransformer: model-level rope_embeddings with 2x2 rotation-matrix freqs_cis, wq/wk/wv/wo, "
    "repeat_kv on dim 2, GQA 4/2 + Meta start_pos cache_k/cache_v; slip: keys and values read back with "
    "[start_pos : start_pos + seqlen] (the write slice), so a decoded token sees only itself",
}


@dataclass
class BaseTransformerArgs:
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 140
    ffn_dim: int = 144
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seqlen: int = 64
    max_batch_size: int = 4


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((cos, -sin, sin, cos), dim=-1).view(*freqs.size(), 2, 2)


def apply_rotary_emb(xq, xk, seq_dim, freqs_cis):
    xq_ = xq.reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.reshape(*xk.shape[:-1], -1, 1, 2)
    shape = [
        d if i == seq_dim or i == xq_.ndim - 3 else 1 for i, d in enumerate(xq_.shape[:-2])
    ] + [2, 2]
    freqs_cis = freqs_cis.view(*shape).to(xq.dtype)
    xq_out = (xq_ * freqs_cis).sum(5).flatten(3)
    xk_out = (xk_ * freqs_cis).sum(5).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep, dim):
    assert dim == 2
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, theta, head_dim, max_seqlen):
        super().__init__()
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(head_dim, max_seqlen, theta), persistent=False
        )

    def forward(self, seqlen: int, start: int = 0):
        return self.freqs_cis[start : start + seqlen]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: BaseTransformerArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.heads_per_group = self.n_heads // self.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        shape = (args.max_batch_size, args.max_seqlen, self.n_kv_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, freq_cis, start_pos: Optional[int] = None):
        bsz, seq_len, dim = x.shape
        xq = self.wq(x.view_as(x)).view(bsz, seq_len, self.n_heads, self.head_dim)
        xk = self.wk(x.view_as(x)).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        xv = self.wv(x.view_as(x)).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, 1, freq_cis[0:seq_len])
        if start_pos is not None:
            self.cache_k = self.cache_k.to(xq)
            self.cache_v = self.cache_v.to(xq)
            self.cache_k[:bsz, start_pos : start_pos + seq_len] = xk
            self.cache_v[:bsz, start_pos : start_pos + seq_len] = xv
            xk = self.cache_k[:bsz, start_pos : start_pos + seq_len]
            xv = self.cache_v[:bsz, start_pos : start_pos + seq_len]
        xk = repeat_kv(xk, self.heads_per_group, dim=2)
        xv = repeat_kv(xv, self.heads_per_group, dim=2)
        n_keys = xk.shape[1]
        mask = torch.ones(seq_len, n_keys, dtype=torch.bool, device=x.device).tril(
            diagonal=n_keys - seq_len
        )
        xq, xk, xv = map(lambda e: e.transpose(1, 2), (xq, xk, xv))
        output = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=mask)
        output = output.transpose(1, 2).contiguous()
        return self.wo(output.reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freq_cis, start_pos=None):
        h = x + self.attention(self.attention_norm(x), freq_cis, start_pos=start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class LMTransformer(nn.Module):
    def __init__(self, args: BaseTransformerArgs):
        super().__init__()
        self.rope_embeddings = RotaryEmbedding(
            args.rope_theta, args.dim // args.n_heads, args.max_seqlen
        )
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.layers:
            layer.attention.cache_k.zero_()
            layer.attention.cache_v.zero_()

    def forward(self, token_values, start_pos: Optional[int] = None, use_cache: bool = False):
        bsz, seqlen = token_values.shape
        if start_pos is None and use_cache:
            start_pos = self.current_pos
        h = self.tok_embeddings(token_values)
        freq_cis = self.rope_embeddings(seqlen=seqlen, start=start_pos or 0)
        for layer in self.layers:
            h = layer(h, freq_cis, start_pos=start_pos)
        if start_pos is not None:
            self.current_pos = start_pos + seqlen
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(811)
    model = LMTransformer(BaseTransformerArgs())
    g = torch.Generator().manual_seed(8111)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()
