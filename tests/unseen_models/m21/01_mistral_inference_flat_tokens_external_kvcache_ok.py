"""mistralai/mistral-inference transformer.py in plain torch (no xformers).

Transformer: tok_embeddings, layers = nn.ModuleDict keyed "0".."2" (the pipeline-parallel layout),
norm, output.  TransformerBlock: attention_norm, attention, ffn_norm, feed_forward (w1/w2/w3 SwiGLU).
Attention: wq/wk/wv/wo without bias, GQA 4/2; the tokens of every sequence are flattened into one
(seqlen_sum, dim) stream as in the reference (xformers BlockDiagonalCausalMask), viewed
(seqlen_sum, heads, head_dim), rotated with complex `freqs_cis` (interleaved pairs, theta 1e6) at the
absolute positions, keys/values repeated with `repeat_interleave(dim=1)` (`repeat_kv`), and attention
is computed per sequence block with a causal mask that lets a block see its cached prefix.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)` (`get(i)`, `update(i, (k, v))`, `seq_len()`;
entries (b, s, kv, d) grown on dim 1), `model(prompt, cache=cache)`, `model(tok, cache=cache)`.
`model.reset_kv_cache()` is a no-op.  Returns the logits tensor.  Correct.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "mistral-inference: ModuleDict layers, flattened (seqlen_sum, dim) tokens with a block-diagonal "
    "causal mask, complex freqs_cis rotary theta 1e6, GQA 4/2 repeat_interleave, external KVCache",
}


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 3
    head_dim: int = 16
    hidden_dim: int = 144
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    vocab_size: int = 96
    rope_theta: float = 1e6


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def reset(self):
        self.cache = [None] * len(self.cache)


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def apply_rotary_emb(xq, xk, freqs_cis):
    cdtype = torch.complex128 if xq.dtype == torch.float64 else torch.complex64
    fc = freqs_cis.to(cdtype)[:, None, :]
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * fc).flatten(-2)
    xk_out = torch.view_as_real(xk_ * fc).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(keys, values, repeats, dim):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=dim)
    values = torch.repeat_interleave(values, repeats=repeats, dim=dim)
    return keys, values


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.n_kv_heads = args.n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.scale = self.args.head_dim ** -0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, seqlens, cache=None, layer_idx=0):
        # x: (seqlen_sum, dim), sequences of equal length `seqlens[0]` laid end to end
        seqlen_sum, _ = x.shape
        bsz, seqlen = len(seqlens), seqlens[0]
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(seqlen_sum, self.n_heads, self.head_dim)
        xk = xk.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xv = xv.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        key = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        val = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if cache is not None:
            past = cache.get(layer_idx)
            if past is not None:
                key = torch.cat([past[0], key], dim=1)
                val = torch.cat([past[1], val], dim=1)
            cache.update(layer_idx, (key, val))
        kv_len = key.shape[1]
        key, val = repeat_kv(key, val, self.repeats, dim=2)

        q = xq.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = key.transpose(1, 2)
        v = val.transpose(1, 2)
        scores = torch.matmul(q * self.scale, k.transpose(-2, -1))
        offset = kv_len - seqlen
        qpos = torch.arange(seqlen, device=x.device)[:, None] + offset
        kpos = torch.arange(kv_len, device=x.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        output = torch.matmul(probs, v).transpose(1, 2).reshape(seqlen_sum, self.n_heads * self.head_dim)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, seqlens, cache, layer_idx):
        r = self.attention(self.attention_norm(x), freqs_cis, seqlens, cache, layer_idx)
        h = x + r
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._precomputed_freqs_cis = None

    @property
    def freqs_cis(self):
        if self._precomputed_freqs_cis is None:
            self._precomputed_freqs_cis = precompute_freqs_cis(
                self.args.head_dim, 128_000 // 1000, self.args.rope_theta
            )
        return self._precomputed_freqs_cis

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        bsz, seqlen = input_ids.shape
        seqlens = [seqlen] * bsz
        start = cache.seq_len() if cache is not None else 0
        positions = (torch.arange(seqlen) + start).repeat(bsz)
        freqs_cis = self.freqs_cis[positions].to(input_ids.device)
        h = self.tok_embeddings(input_ids.reshape(-1))
        for local_layer_id, layer in enumerate(self.layers.values()):
            h = layer(h, freqs_cis, seqlens, cache, local_layer_id)
        logits = self.output(self.norm(h))
        return logits.view(bsz, seqlen, -1)


def make_model():
    torch.manual_seed(2101)
    model = Transformer(ModelArgs())
    g = torch.Generator().manual_seed(21011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
