"""Llama 3.2 as written in tracel-ai's llama-burn (Rust, burn framework), ported to torch module by module.

Transformer { tok_embeddings, layers: Vec<TransformerBlock>, norm, output }; TransformerBlock
{ attention, feed_forward (w1/w2/w3 SwiGLU), attention_norm, ffn_norm }; MultiHeadAttention
{ wq, wk, wv, wo, n_heads 4, n_kv_heads 2, head_dim 16 } (no biases).  The rotary encoding is burn's
RotaryEncoding: a (max_len, d/2, 2) table of cos/sin computed once (theta 5e5 with Llama-3 frequency
scaling: factor 8, low/high freq factors 1 and 4, original context 8192) and applied to adjacent pairs
(x0, x1) at `start = cache.len()`.  Keys/values go through the layer's KeyValueCache (an
AutoregressiveCache per tensor, shape (b, kv, s, d), grown on dim 2), then `repeat_kv`
(expand + reshape: query head h reads kv head h // 2); scores q @ k^T / sqrt(d), a causal mask aligned to
the bottom right (the mask generated for (seq_len, cache_len + seq_len)) filled with -inf, softmax.
Cache: book-cache.  `cache = mod.KVCache(n_layers=3)` (llama-burn's TransformerCache), then
`model.reset_kv_cache()`, `model(prompt, cache=cache)`, `model(tok, cache=cache)`.  `model(ids)` is the
full pass (a throw-away cache).  Correct everywhere.
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
    "style": "llama-burn (Rust) Llama 3.2 port: wq/wk/wv/wo, GQA 4/2 repeat_kv, burn RotaryEncoding on adjacent "
    "pairs at cache.len() with llama3 frequency scaling theta 5e5, external TransformerCache of "
    "AutoregressiveCache pairs passed as cache=",
}


class AutoregressiveCache:
    def __init__(self):
        self.cache = None

    def forward(self, tensor):
        self.cache = tensor if self.cache is None else torch.cat([self.cache, tensor], dim=2)
        return self.cache

    def len(self):
        return 0 if self.cache is None else self.cache.shape[2]


class KeyValueCache:
    def __init__(self):
        self.key = AutoregressiveCache()
        self.value = AutoregressiveCache()

    def forward(self, key, value):
        return self.key.forward(key), self.value.forward(value)

    def len(self):
        return self.key.len()


class KVCache:
    """llama-burn's TransformerCache: one KeyValueCache per layer."""

    def __init__(self, n_layers):
        self.n_layers = n_layers
        self.layers = [KeyValueCache() for _ in range(n_layers)]

    def reset(self):
        self.layers = [KeyValueCache() for _ in range(self.n_layers)]


def llama3_scaled_freqs(head_dim, theta, factor=8.0, low=1.0, high=4.0, old_ctx=8192):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


class RotaryEncoding(nn.Module):
    def __init__(self, d_model, max_seq_len, theta):
        super().__init__()
        freqs = llama3_scaled_freqs(d_model, theta)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
        # (max_len, d/2, 2): [cos, sin] per pair, kept in float64 and cast at use
        self.freq_complex = torch.stack([angles.cos(), angles.sin()], dim=-1)

    def apply(self, x, start):
        b, h, s, d = x.shape
        table = self.freq_complex[start : start + s].to(device=x.device, dtype=x.dtype)
        cos, sin = table[..., 0], table[..., 1]
        pairs = x.reshape(b, h, s, d // 2, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return out.reshape(b, h, s, d)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def repeat_kv(self, x):
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep == 1:
            return x
        b, kv, s, d = x.shape
        return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)

    def forward(self, x, cache, rope):
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).reshape(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).reshape(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        start = cache.len()
        q = rope.apply(q, start)
        k = rope.apply(k, start)
        k, v = cache.forward(k, v)
        total = k.shape[2]
        k = self.repeat_kv(k)
        v = self.repeat_kv(v)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if s > 1:
            mask = torch.ones(s, total, dtype=torch.bool, device=x.device).triu(total - s + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.wo(out)


class RmsNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gamma


class FeedForward(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention = MultiHeadAttention(d_model, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(d_model, hidden)
        self.attention_norm = RmsNorm(d_model)
        self.ffn_norm = RmsNorm(d_model)

    def forward(self, x, cache, rope):
        h = x + self.attention(self.attention_norm(x), cache, rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab_size=96, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden=128, max_seq_len=128):
        super().__init__()
        self.n_layers = n_layers
        self.tok_embeddings = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList([TransformerBlock(d_model, n_heads, n_kv_heads, hidden) for _ in range(n_layers)])
        self.norm = RmsNorm(d_model)
        self.output = nn.Linear(d_model, vocab_size, bias=False)
        self.rope = RotaryEncoding(d_model // n_heads, max_seq_len, 500000.0)

    def reset_kv_cache(self):
        pass  # the cache lives outside the model; a fresh KVCache is the reset

    def forward(self, tokens, cache=None):
        if cache is None:
            cache = KVCache(self.n_layers)
        h = self.tok_embeddings(tokens)
        for layer, layer_cache in zip(self.layers, cache.layers):
            h = layer(h, layer_cache, self.rope)
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(1503)
    model = Transformer()
    g = torch.Generator().manual_seed(15031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RmsNorm):
                m.gamma.copy_(1.0 + 0.3 * torch.randn(m.gamma.shape, generator=g))
    return model.eval()
