"""LLaMA as tinygrad's `extra/models/llama.py` writes it, ported to torch (written from memory, in my
own words): `Transformer` with `tok_embeddings`, `layers` (TransformerBlock: attention, feed_forward,
attention_norm, ffn_norm), `norm`, `output`, a `freqs_cis` table of stacked (cos, sin) pairs and
`apply_rotary_emb` that multiplies interleaved pairs as complex numbers by hand (`complex_mult`);
`Attention` has wq/wk/wv/wo (no bias) and ONE lazily created cache tensor `cache_kv` of shape
(2, batch, max_context, n_kv_heads, head_dim) written with `cache_kv[:, :bsz, start_pos:start_pos +
seqlen] = stack(xk, xv)`, GQA 4/2 through `repeat_kv`, and attention via
`F.scaled_dot_product_attention(q, k, v, attn_mask=mask)`.  RMSNorm, SwiGLU w1/w2/w3, rope theta
10000, dim 64, 3 layers, vocab 140, max_context 64 (batch ≤ 8).  tinygrad samples inside forward;
this port returns logits (batch, tokens, vocab) as a tensor.

Cache (book-buffers, Meta style): `model(tokens, start_pos)`; `model(tokens)` is the full forward
(start_pos 0).  Also `model.reset_kv_cache()` then `model(tokens, use_cache=True)` with the model's
own position counter.

Decode slip: the port builds the mask on every call as
`full((1, 1, seqlen, start_pos + seqlen), -inf).triu(1)` (tinygrad offsets the diagonal by
`start_pos + 1` and skips the mask for one token).  The prompt (start_pos 0) is exact; a decoded
token's row masks every key after key 0, so it sees only the first prompt token.
decode `cache_mask`, step 0, `layers.0.attention`.
"""

import math

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
    "style": "tinygrad extra/models/llama.py ported: stacked cache_kv (2, b, ctx, kv, d), freqs_cis (cos, sin) pairs with "
    "complex_mult (interleaved), SDPA with attn_mask, forward(tokens, start_pos); slip: mask triu(1) without start_pos",
}


class Args:
    dim = 64
    hidden_dim = 128
    n_heads = 4
    n_kv_heads = 2
    n_layers = 3
    norm_eps = 1e-5
    vocab_size = 140
    max_context = 64
    max_batch = 8
    rope_theta = 10000.0


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    freqs = torch.arange(end, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1).reshape(1, end, 1, dim // 2, 2)


def complex_mult(A, c, d):
    a, b = A[..., 0:1], A[..., 1:2]
    ro = a * c - b * d
    co = a * d + b * c
    return torch.cat([ro, co], dim=-1)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq = xq.reshape(*xq.shape[0:-1], -1, 2)
    xk = xk.reshape(*xk.shape[0:-1], -1, 2)
    c, d = freqs_cis[..., 0:1].to(xq.dtype), freqs_cis[..., 1:2].to(xq.dtype)
    xq_out = complex_mult(xq, c, d)
    xk_out = complex_mult(xk, c, d)
    return xq_out.flatten(3), xk_out.flatten(3)


def repeat_kv(x, n_rep):
    bs, seqlen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, max_context):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.max_context = max_context
        self.wq = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.cache_kv = None

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.reshape(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)

        if self.cache_kv is None or self.cache_kv.dtype != x.dtype:
            self.cache_kv = torch.zeros(
                2, Args.max_batch, self.max_context, self.n_kv_heads, self.head_dim, dtype=x.dtype
            )
        self.cache_kv[:, :bsz, start_pos : start_pos + seqlen] = torch.stack([xk, xv])
        keys = self.cache_kv[0, :bsz, 0 : start_pos + seqlen]
        values = self.cache_kv[1, :bsz, 0 : start_pos + seqlen]

        keys, values = repeat_kv(keys, self.n_rep), repeat_kv(values, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        attn = F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask).transpose(1, 2)
        return self.wo(attn.reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.max_context)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, start_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_context = args.max_context
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.dim // args.n_heads, args.max_context * 2, args.rope_theta),
            persistent=False,
        )
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.layers:
            layer.attention.cache_kv = None

    def forward(self, tokens, start_pos=None, use_cache=False):
        if start_pos is None:
            start_pos = self.current_pos if use_cache else 0
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:, start_pos : start_pos + seqlen]
        mask = torch.full((1, 1, seqlen, start_pos + seqlen), float("-inf"), dtype=h.dtype).triu(1)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        if use_cache:
            self.current_pos = start_pos + seqlen
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(6116)
    model = Transformer(Args())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
