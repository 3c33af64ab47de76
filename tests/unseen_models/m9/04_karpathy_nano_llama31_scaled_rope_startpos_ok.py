"""karpathy/nano-llama31 (llama31.py): a minimal Llama 3.1 with Meta's names (small, random weights).

Transformer: tok_embeddings, layers.N (TransformerBlock: attention_norm, attention, ffn_norm,
feed_forward w1/w2/w3), norm, output.  Attention: wq/wk/wv/wo without bias, n_heads 4, n_kv_heads 2
(`repeat_kv` on (b, s, kv, d), repeat_interleave order), complex `freqs_cis` (interleaved pairs)
from `precompute_freqs_cis(..., use_scaled_rope=True)` with Llama 3.1's `apply_scaling`
(factor 8, low_freq_factor 1, high_freq_factor 4, original context 8192) and theta 5e5, F.scaled-style
attention written out: (q @ k^T) / sqrt(head_dim) + additive -inf causal mask, float softmax.
Each attention owns a KVCache (cache_k / cache_v of (max_batch 4, max_seq 64, kv, d)).
Cache: book-buffers with `start_pos`: `model(prompt, start_pos=0)`, then `model(tok, start_pos=L)`;
or `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`
(`current_pos` supplies start_pos).  `model(ids)` with neither is the plain causal forward and touches
no cache.  Returns the logits tensor.  Correct everywhere.
"""

import math

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
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {"heads": 4, "kv_heads": 2, "head_dim": 16, "causal": True, "cross": False,
                  "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 500000.0},
                  "qk_norm": None, "window": None, "bias": None},
    "style": "nano-llama31 llama31.py: Meta names, KVCache module per attention, complex freqs_cis with Llama 3.1 "
    "apply_scaling (factor 8), GQA 4/2 repeat_kv, -inf additive mask, start_pos or use_cache",
}


class ModelArgs:
    dim = 64
    n_layers = 3
    n_heads = 4
    n_kv_heads = 2
    vocab_size = 128
    ffn_dim_multiplier = 1.3
    multiple_of = 32
    norm_eps = 1e-5
    rope_theta = 500000.0
    use_scaled_rope = True
    max_batch_size = 4
    max_seq_len = 64


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_scaling(freqs):
    scale_factor = 8
    low_freq_factor = 1
    high_freq_factor = 4
    old_context_len = 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=freqs.dtype, device=freqs.device)


def precompute_freqs_cis(dim, end, theta=10000.0, use_scaled=False):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    if use_scaled:
        freqs = apply_scaling(freqs)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_).to(xq_.dtype)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim)


class KVCache(nn.Module):
    def __init__(self, batch_size, seq_length, n_kv_heads, head_dim):
        super().__init__()
        cache_shape = (batch_size, seq_length, n_kv_heads, head_dim)
        self.register_buffer("cache_k", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(cache_shape), persistent=False)

    def update(self, start_pos, xk, xv):
        seqlen = xk.size(1)
        self.cache_k[: xk.size(0), start_pos : start_pos + seqlen] = xk
        self.cache_v[: xv.size(0), start_pos : start_pos + seqlen] = xv
        return self.cache_k[: xk.size(0), : start_pos + seqlen], self.cache_v[: xv.size(0), : start_pos + seqlen]


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.cache = KVCache(args.max_batch_size, args.max_seq_len, self.n_kv_heads, self.head_dim)

    def forward(self, x, start_pos, freqs_cis, mask, use_cache):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        if use_cache:
            xk, xv = self.cache.update(start_pos, xk, xv)
        xk = repeat_kv(xk, self.n_rep)
        xv = repeat_kv(xv, self.n_rep)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).type_as(xq)
        output = torch.matmul(scores, xv).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, freqs_cis, mask, use_cache):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask, use_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(params) for _ in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        # complex table kept as a plain attribute (as Meta does), so .to(dtype) cannot drop its imaginary part
        self.freqs_cis = precompute_freqs_cis(
            params.dim // params.n_heads, params.max_seq_len * 2, params.rope_theta, params.use_scaled_rope)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0

    def forward(self, tokens, start_pos=None, use_cache=False):
        _bsz, seqlen = tokens.shape
        if start_pos is not None:
            use_cache = True
        elif use_cache:
            start_pos = self.current_pos
        else:
            start_pos = 0
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis.to(tokens.device)[start_pos : start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1)
            kv_len = start_pos + seqlen if use_cache else seqlen
            mask = torch.hstack([torch.zeros((seqlen, kv_len - seqlen), device=tokens.device), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask, use_cache)
        if use_cache:
            self.current_pos = start_pos + seqlen
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(904)
    model = Transformer(ModelArgs())
    g = torch.Generator().manual_seed(9041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
