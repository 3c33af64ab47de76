"""AI-Hypercomputer/jetstream-pytorch Llama (jetstream_pt/third_party/llama/model_exportable.py) in plain torch.

Transformer: tok_embeddings, layers.N (TransformerBlock: attention_norm, attention, ffn_norm,
feed_forward w1/w2/w3), norm, output.  Attention: wq/wk/wv/wo without bias, GQA 4 query heads over 2
kv heads, complex `freqs_cis` rotary (interleaved pairs, theta 5e5), keys/values moved to the
(batch, heads, seq, dim) layout the engine keeps its cache in, then an AttentionKernel that repeats
the kv heads (`repeat_kv`), scales by 1/sqrt(head_dim), adds the additive mask (-inf above the
diagonal) and takes the softmax in float.
Cache: the engine's split between a prefill cache (KVCachePrefill: just keeps what it is given) and a
generate cache (KVCacheGenerate: appends the one new token) is kept as the two `update` paths of a
per-layer view; the whole-model object is `KVCache(n_layers=...)` passed as `cache=`.
Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "jetstream-pytorch llama model_exportable.py: wq/wk/wv/wo, GQA 4/2 repeat_kv, complex freqs_cis "
    "(interleaved) theta 5e5, (b, h, s, d) cache layout, KVCachePrefill/KVCacheGenerate update paths, "
    "AttentionKernel with -inf additive mask",
}


class KVCache:
    """Whole-model cache: one (keys, values) pair per layer, each (b, kv_heads, seq, head_dim)."""

    def __init__(self, n_layers):
        self.n_layers = n_layers
        self.cache = [None] * n_layers

    def get(self, i):
        return self.cache[i]

    def update(self, i, kv):
        self.cache[i] = kv

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[2]

    def layer_view(self, i):
        return _LayerCache(self, i)


class _LayerCache:
    """KVCachePrefill when the layer has nothing yet, KVCacheGenerate afterwards."""

    def __init__(self, owner, idx):
        self.owner = owner
        self.idx = idx

    def update(self, key, value):
        past = self.owner.get(self.idx)
        if past is None:  # prefill: keep the prompt's keys and values as they are
            self.owner.update(self.idx, (key, value))
            return key, value
        cache_k, cache_v = past  # generate: append the new token on the seq axis
        cache_k = torch.cat([cache_k, key], dim=2)
        cache_v = torch.cat([cache_v, value], dim=2)
        self.owner.update(self.idx, (cache_k, cache_v))
        return cache_k, cache_v


def precompute_freqs_cis(dim, positions, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    angles = torch.outer(positions.to(torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex128


def apply_rotary_emb(xq, xk, freqs_cis):
    # xq: (b, s, h, d); pairs (x[2i], x[2i+1]) read as complex numbers
    def rot(x):
        xc = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2).contiguous())
        out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
        return out.to(x.dtype)

    return rot(xq), rot(xk)


def repeat_kv(x, n_rep):
    # (b, kv, s, d) -> (b, kv * n_rep, s, d), query head h reads kv head h // n_rep
    b, kv, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class AttentionKernel:
    def __init__(self, n_rep):
        self.n_rep = n_rep

    def __call__(self, xq, keys, values, mask):
        keys = repeat_kv(keys, self.n_rep)
        values = repeat_kv(values, self.n_rep)
        scores = torch.einsum("bhqd,bhkd->bhqk", xq, keys) / math.sqrt(xq.shape[-1])
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float() if scores.dtype != torch.float64 else scores, dim=-1).type_as(xq)
        return torch.einsum("bhqk,bhkd->bhqd", scores, values)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.attention_kernel = AttentionKernel(self.n_rep)

    def forward(self, x, freqs_cis, mask, cache=None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xq = xq.transpose(1, 2)
        xk = xk.transpose(1, 2)
        xv = xv.transpose(1, 2)
        if cache is not None:
            keys, values = cache.update(xk, xv)
        else:
            keys, values = xk, xv
        output = self.attention_kernel(xq, keys, values, mask)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, mask, cache=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.params = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(i, args) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, tokens, cache=None):
        bsz, seqlen = tokens.shape
        start = cache.seq_len() if cache is not None else 0
        h = self.tok_embeddings(tokens)
        positions = torch.arange(start, start + seqlen, device=tokens.device)
        freqs_cis = precompute_freqs_cis(self.params.dim // self.params.n_heads, positions, self.params.rope_theta)
        total = start + seqlen
        mask = torch.full((seqlen, total), float("-inf"), dtype=h.dtype, device=tokens.device)
        mask = torch.triu(mask, diagonal=start + 1)[None, None]
        for layer in self.layers:
            view = cache.layer_view(layer.layer_id) if cache is not None else None
            h = layer(h, freqs_cis, mask, view)
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(2201)
    args = SimpleNamespace(
        vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160,
        norm_eps=1e-5, rope_theta=500000.0,
    )
    model = Transformer(args)
    g = torch.Generator().manual_seed(22011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
