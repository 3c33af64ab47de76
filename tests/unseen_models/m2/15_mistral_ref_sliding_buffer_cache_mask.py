"""A tiny Mistral in the style of mistral-src's one-file reference (mistral/model.py, 2023).

Transformer(tok_embeddings, layers ModuleList of TransformerBlock(attention, feed_forward,
attention_norm, ffn_norm), norm, output).  Attention keeps cache_k / cache_v tensors
(max_batch_size, ..., n_kv_heads, head_dim), GQA 4/1 (MQA) with repeat_interleave, complex
rotary (interleaved pairs).  Every layer is a sliding-window layer (sliding_window 4: a query
sees itself and the 3 keys before it).  Multi-token calls use the fresh keys and the banded
mask tril(.) * triu(., -(sliding_window - 1)) turned into 0/-inf with log.  One-token calls
read the cache: key = cache_k[:bsz, :cur_pos].

Calling (book-buffers): model(tokens, start_pos) with an explicit start position, or
model.reset_kv_cache() then model(tokens, use_cache=True), which tracks start_pos itself.
A plain model(tokens) neither reads nor writes the cache.

Slip: the original keeps a rotating buffer of exactly sliding_window slots written at
position % sliding_window.  This port replaced it with a plain max_seq_len buffer written at
the absolute position, but kept the decode read cache_k[:bsz, :cur_pos] and still applies no
mask on one-token steps.  So a decoded token attends to the whole history instead of its
last 4 keys.  The full forward is right.  With a prompt of at least 4 tokens this shows at
step 0, in layers.0.attention.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "layers.0.attention"},
    "style": "mistral-src one-file model.py: sliding_window band mask via log(triu(tril)), complex rotary, "
    "repeat_interleave MQA, decode reads cache_k[:bsz, :cur_pos]; slip: non-rotating buffer, so decode sees "
    "the whole history instead of the window",
}


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 3
    head_dim: int = 16
    hidden_dim: int = 128
    n_heads: int = 4
    n_kv_heads: int = 1
    sliding_window: int = 4
    norm_eps: float = 1e-5
    vocab_size: int = 128
    max_batch_size: int = 8
    max_seq_len: int = 64
    rope_theta: float = 10000.0


def repeat_kv(keys, values, repeats):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=2)
    values = torch.repeat_interleave(values, repeats=repeats, dim=2)
    return keys, values


def _reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1]), (freqs_cis.shape, x.shape)
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = _reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.sliding_window = args.sliding_window
        self.scale = args.head_dim**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache_k = torch.empty(
            (args.max_batch_size, args.max_seq_len, self.n_kv_heads, args.head_dim)
        )
        self.cache_v = torch.empty(
            (args.max_batch_size, args.max_seq_len, self.n_kv_heads, args.head_dim)
        )

    def forward(
        self, x, freqs_cis, positions, mask: Optional[torch.Tensor], use_cache: bool = True
    ):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.args.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        if use_cache:
            self.cache_k = self.cache_k.to(xq)
            self.cache_v = self.cache_v.to(xq)
            self.cache_k[:bsz, positions] = xk.detach()
            self.cache_v[:bsz, positions] = xv.detach()

        if positions.shape[0] > 1 or not use_cache:
            key, value = repeat_kv(xk, xv, self.repeats)
        else:
            cur_pos = positions[-1].item() + 1
            key, value = repeat_kv(
                self.cache_k[:bsz, :cur_pos, ...], self.cache_v[:bsz, :cur_pos, ...], self.repeats
            )

        query = xq.transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scale
        if mask is not None:
            scores = scores + mask[None, None, ...]
        scores = scores.float() if scores.dtype != torch.float64 else scores
        scores = nn.functional.softmax(scores, dim=-1).type_as(query)
        output = torch.matmul(scores, value)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float() if x.dtype != torch.float64 else x).type_as(x)
        return output * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args=args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.args = args

    def forward(self, x, freqs_cis, positions, mask, use_cache=True):
        r = self.attention(self.attention_norm(x), freqs_cis, positions, mask, use_cache)
        h = x + r
        return h + self.feed_forward(self.ffn_norm(h))


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = torch.nn.ModuleList(
            [TransformerBlock(args=args) for _ in range(args.n_layers)]
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(
            args.head_dim, args.max_seq_len * 2, theta=args.rope_theta
        )
        self._next_pos = 0

    def reset_kv_cache(self):
        for layer in self.layers:
            layer.attention.cache_k = torch.zeros_like(layer.attention.cache_k)
            layer.attention.cache_v = torch.zeros_like(layer.attention.cache_v)
        self._next_pos = 0

    def forward(self, input_ids, start_pos: Optional[int] = None, use_cache: bool = False):
        caching = use_cache or start_pos is not None
        if start_pos is None:
            start_pos = self._next_pos if use_cache else 0
        seqlen = input_ids.shape[1]
        positions = torch.arange(start_pos, start_pos + seqlen)
        h = self.tok_embeddings(input_ids)
        freqs_cis = self.freqs_cis[positions]

        mask: Optional[torch.Tensor] = None
        if input_ids.shape[1] > 1:
            tensor = torch.full((seqlen, seqlen), fill_value=1)
            mask = torch.tril(tensor, diagonal=0).to(h.dtype)
            mask = torch.triu(mask, diagonal=-(self.args.sliding_window - 1))
            mask = torch.log(mask)

        for layer in self.layers:
            h = layer(h, freqs_cis, positions, mask, caching)
        if caching:
            self._next_pos = start_pos + seqlen
        return self.output(self.norm(h)).float()


def make_model():
    torch.manual_seed(1515)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
