"""likejazz/llama3.np (llama3.py, a NumPy Llama 3) ported to torch module by module.

The NumPy tree is kept: Llama holds tok_embedding, layers (TransformerBlock: input_layernorm, attention,
post_attention_layernorm, feed_forward), norm, and a raw lm_head_weight.  Weights are plain arrays in
(in, out) layout applied as x @ W (q_weight/k_weight/v_weight/o_weight, up/gate/down_weight), as the
NumPy code stores them after transposing the checkpoint.  Rotary from compute_cos_sin_cache (float64
here, cast at use) applied to interleaved pairs ((-1, 2) reshape into real/imag parts), base 5e5.
GQA 4/2 through an np.repeat-style repeat_kv on axis 2 of (b, s, kv, d).  The mask is an additive
-inf triu(1) block hstacked after zeros for the cached columns, only built when L > 1.
Cache: book-buffers.  Each Attention owns cache_k/cache_v (max_batch 4, max_seq_len 64, kv, d),
written at [:, start_pos:start_pos+L].  `model(ids, start_pos=0)`, `model(tok, start_pos=L)`; or
`model.reset_kv_cache()`, `model(ids, use_cache=True)`, `model(tok, use_cache=True)` (current_pos
tracked on the model).  `model(ids)` with neither touches no cache.  Returns the logits tensor.
Correct model.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": None, "step": None, "layer": None},
    "style": "llama3.np ported: (in, out) weight arrays applied as x @ W, interleaved-pair rotary from "
    "compute_cos_sin_cache base 5e5, GQA 4/2 np.repeat-style repeat_kv, -inf triu mask hstacked after zeros, "
    "per-attention cache_k/cache_v written at start_pos",
}


def compute_cos_sin_cache(head_dim, max_seq_len, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64)[: (head_dim // 2)] / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    # xq: (b, L, h, d) ; freqs: (L, d/2)
    xqri = xq.reshape(xq.shape[:-1] + (-1, 2))
    xkri = xk.reshape(xk.shape[:-1] + (-1, 2))
    xq_r, xq_i = xqri[..., 0], xqri[..., 1]
    xk_r, xk_i = xkri[..., 0], xkri[..., 1]
    freqs_cos = freqs_cos[None, :, None, :]
    freqs_sin = freqs_sin[None, :, None, :]
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).reshape(xq.shape)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).reshape(xk.shape)
    return xq_out, xk_out


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    return torch.repeat_interleave(x, n_rep, dim=2)


def softmax(x):
    exp_x = torch.exp(x - torch.max(x, dim=-1, keepdim=True).values)
    return exp_x / torch.sum(exp_x, dim=-1, keepdim=True)


def silu(x):
    return x * (1 / (1 + torch.exp(-x)))


def _w(fan_in, fan_out):
    return nn.Parameter(torch.randn(fan_in, fan_out) / math.sqrt(fan_in))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.up_weight = _w(dim, hidden_dim)
        self.gate_weight = _w(dim, hidden_dim)
        self.down_weight = _w(hidden_dim, dim)

    def forward(self, x):
        swish = silu(x @ self.gate_weight)
        x_v = x @ self.up_weight
        return (swish * x_v) @ self.down_weight


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        z = (x**2).mean(-1, keepdim=True) + self.eps
        return self.weight * (x / torch.sqrt(z))


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_kv_heads = args.n_kv_heads
        self.n_local_heads = args.n_heads
        self.n_local_kv_heads = args.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.q_weight = _w(args.dim, args.n_heads * self.head_dim)
        self.k_weight = _w(args.dim, args.n_kv_heads * self.head_dim)
        self.v_weight = _w(args.dim, args.n_kv_heads * self.head_dim)
        self.o_weight = _w(args.n_heads * self.head_dim, args.dim)
        shape = (args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, start_pos, mask, freqs_cos, freqs_sin, use_cache):
        B, L, _ = x.shape
        xq = (x @ self.q_weight).reshape(B, L, self.n_local_heads, self.head_dim)
        xk = (x @ self.k_weight).reshape(B, L, self.n_local_kv_heads, self.head_dim)
        xv = (x @ self.v_weight).reshape(B, L, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        if use_cache:
            self.cache_k[:B, start_pos : start_pos + L] = xk
            self.cache_v[:B, start_pos : start_pos + L] = xv
            ks = self.cache_k[:B, : start_pos + L]
            vs = self.cache_v[:B, : start_pos + L]
        else:
            ks, vs = xk, xv
        xk = repeat_kv(ks, self.n_rep)
        xv = repeat_kv(vs, self.n_rep)
        xq = xq.transpose(1, 2)
        xk = xk.transpose(1, 2)
        xv = xv.transpose(1, 2)
        attention = xq @ xk.transpose(-1, -2) / math.sqrt(self.head_dim)
        if mask is not None:
            attention = attention + mask[None, None, :, :]
        attention = softmax(attention)
        output = attention @ xv
        output = output.transpose(1, 2).reshape(B, L, -1)
        return output @ self.o_weight


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.input_layernorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, mask, freqs_cos, freqs_sin, use_cache):
        norm_x = self.input_layernorm(x)
        h1 = self.attention(norm_x, start_pos, mask, freqs_cos, freqs_sin, use_cache)
        z = x + h1
        return z + self.feed_forward(self.post_attention_layernorm(z))


class Llama(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embedding = nn.Parameter(torch.randn(args.vocab_size, args.dim))
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head_weight = _w(args.dim, args.vocab_size)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.layers:
            layer.attention.cache_k.zero_()
            layer.attention.cache_v.zero_()

    def forward(self, input_ids, start_pos=None, use_cache=False):
        _, L = input_ids.shape
        if start_pos is not None:
            use_cache = True
        elif use_cache:
            start_pos = self.current_pos
        else:
            start_pos = 0
        h = self.tok_embedding[input_ids]
        cos_t, sin_t = compute_cos_sin_cache(
            self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.rope_theta
        )
        freqs_cos = cos_t[start_pos : start_pos + L].to(h.dtype)
        freqs_sin = sin_t[start_pos : start_pos + L].to(h.dtype)
        mask = None
        if L > 1:
            mask = torch.full((L, L), float("-inf"), dtype=h.dtype)
            mask = torch.triu(mask, diagonal=1)
            if use_cache:
                mask = torch.hstack([torch.zeros((L, start_pos), dtype=h.dtype), mask])
        for layer in self.layers:
            h = layer(h, start_pos, mask, freqs_cos, freqs_sin, use_cache)
        if use_cache:
            self.current_pos = start_pos + L
        h = self.norm(h)
        return h @ self.lm_head_weight


def make_model():
    torch.manual_seed(1702)
    args = SimpleNamespace(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=96,
        ffn_dim=160,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_batch_size=4,
        max_seq_len=64,
    )
    model = Llama(args)
    g = torch.Generator().manual_seed(17021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
