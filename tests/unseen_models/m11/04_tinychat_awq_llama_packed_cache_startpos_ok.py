"""MIT Han Lab TinyChat (llm-awq tinychat/models/llama.py) without the AWQ kernels.

Transformer: tok_embeddings, layers.N (TransformerBlock: attention_norm, self_attn, ffn_norm,
feed_forward), norm, output.  LlamaAttentionFused: one fused `qkv_proj` (q | k | v), `o_proj`, GQA 4/2,
complex rotary (view_as_complex on interleaved pairs, freqs_cis with theta 1e4) and TinyChat's packed
key cache: `cache_k` is (batch, kv_heads, head_dim // 8, max_seq_len, 8) (the layout its fused decode
kernel reads), `cache_v` is (batch, kv_heads, max_seq_len, head_dim).  Both are written at start_pos and
read back through a permute/reshape; scores are matmul / sqrt(d) + an additive -inf triu mask with
start_pos columns visible.
Cache: book-buffers: Meta-style `model(ids, start_pos=p)`, or `model(ids, use_cache=True)` with the
position tracked internally, `model.reset_kv_cache()` between sequences; buffers hold batch <= 4 and
64 positions.  Logits tensor.  Correct.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "TinyChat llama.py: fused qkv_proj, complex interleaved rotary, packed cache_k (b, kv, d/8, S, 8) written "
    "at start_pos, GQA 4/2 repeat_interleave, start_pos or use_cache + reset_kv_cache()",
}


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 96
    hidden_dim: int = 176
    norm_eps: float = 1e-5
    max_batch_size: int = 4
    max_seq_len: int = 64
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    return torch.outer(t, freqs)  # angles, turned into complex at use


def apply_rotary_emb(xq, xk, angles):
    freqs_cis = torch.polar(torch.ones_like(angles), angles)  # complex128
    xq_ = torch.view_as_complex(xq.to(torch.float64).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(torch.float64).reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis[None, :, None, :]
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.to(xq.dtype), xk_out.to(xk.dtype)


class LlamaAttentionFused(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_local_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.n_rep = self.n_local_heads // self.n_kv_heads
        self.qkv_proj = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.register_buffer("cache_k", torch.zeros(args.max_batch_size, self.n_kv_heads, self.head_dim // 8,
                                                    args.max_seq_len, 8), persistent=False)
        self.register_buffer("cache_v", torch.zeros(args.max_batch_size, self.n_kv_heads, args.max_seq_len,
                                                    self.head_dim), persistent=False)

    def forward(self, x, start_pos, angles, mask, use_cache):
        bsz, seqlen, _ = x.shape
        xqkv = self.qkv_proj(x)
        q_sz, kv_sz = self.n_local_heads * self.head_dim, self.n_kv_heads * self.head_dim
        xq, xk, xv = xqkv.split([q_sz, kv_sz, kv_sz], dim=-1)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, angles)

        if use_cache:
            self.cache_k = self.cache_k.to(xq)
            self.cache_v = self.cache_v.to(xq)
            packed = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim // 8, 8).permute(0, 2, 3, 1, 4)
            self.cache_k[:bsz, :, :, start_pos:start_pos + seqlen, :] = packed
            self.cache_v[:bsz, :, start_pos:start_pos + seqlen, :] = xv.transpose(1, 2)
            keys = self.cache_k[:bsz, :, :, : start_pos + seqlen, :].permute(0, 1, 3, 2, 4)
            keys = keys.reshape(bsz, self.n_kv_heads, start_pos + seqlen, self.head_dim)
            values = self.cache_v[:bsz, :, : start_pos + seqlen, :]
        else:
            keys, values = xk.transpose(1, 2), xv.transpose(1, 2)

        keys = torch.repeat_interleave(keys, self.n_rep, dim=1)
        values = torch.repeat_interleave(values, self.n_rep, dim=1)
        xq = xq.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float() if scores.dtype != torch.float64 else scores, dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.o_proj(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = LlamaAttentionFused(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, angles, mask, use_cache):
        h = x + self.self_attn(self.attention_norm(x), start_pos, angles, mask, use_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList([TransformerBlock(i, params) for i in range(params.n_layers)])
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.register_buffer("freqs", precompute_freqs(params.dim // params.n_heads, params.max_seq_len * 2,
                                                       params.rope_theta), persistent=False)
        self.cur_pos = 0

    def reset_kv_cache(self):
        self.cur_pos = 0
        for layer in self.layers:
            layer.self_attn.cache_k.zero_()
            layer.self_attn.cache_v.zero_()

    def forward(self, tokens, start_pos=None, use_cache=False):
        if start_pos is not None:
            use_cache = True
        elif use_cache:
            start_pos = self.cur_pos
        else:
            start_pos = 0
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        angles = self.freqs.to(torch.float64)[start_pos:start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=tokens.device), mask]).to(h.dtype)
        for layer in self.layers:
            h = layer(h, start_pos, angles, mask, use_cache)
        if use_cache:
            self.cur_pos = start_pos + seqlen
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(1104)
    model = Transformer(ModelArgs())
    g = torch.Generator().manual_seed(11041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
