"""MegEngine/InferLLM's LLaMA graph (src/graph/llama.cpp, src/core/op.cpp: LlamaAttention, the
AttentionBase with its `m_kstorage`/`m_vstorage`) ported from C++ to PyTorch.

InferLLM loads LLaMA checkpoints under their original names, so the tree is `tok_embeddings`,
`layers.N` (`attention_norm`, `attention` with wq/wk/wv/wo, `ffn_norm`, `feed_forward` w1/w2/w3),
`norm`, `output`.  The attention keeps per-layer K/V storages of (batch <= 4, ctx 64, heads, head_dim)
as buffers, a past length `m_past`, rotates q and k with the GGML "mode 0" rotary (interleaved pairs,
theta 1e4) at positions m_past + i, copies the new k/v into the storages at [m_past, m_past + s),
reads back [0, m_past + s), scales by 1/sqrt(d), masks the future with -inf, softmax, and wo.
MHA 4 x 16, 3 layers.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; `model(ids)` leaves the storages alone.  Returns logits.
Slip: the decode branch (taken once m_past > 0) writes the new key/value into `storage.clone()` (a leftover of
the op's "output tensor" contract, the result is never assigned back) and then reads the real storage:
the decoded token's own slot is still zero, and nothing decoded is ever stored.  The prompt branch
(m_past == 0) writes in place, so the prompt pass and the full forward are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_stale",
        "step": 0,
        "layer": "layers.0.attention",
    },
    "style": "MegEngine InferLLM llama graph ported: wq/wk/wv/wo, GGML mode-0 (interleaved) rotary at m_past + i, "
    "per-layer m_kstorage/m_vstorage buffers (b, ctx, h, d); the decode branch writes into storage.clone() "
    "and reads the unwritten storage",
}

MAX_BATCH = 4
MAX_CTX = 64


def rope_mode0(x, positions, theta):
    # x: (b, s, h, d); rotate consecutive pairs (x[2i], x[2i+1]) by pos * theta^(-2i/d)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.to(torch.float64)[:, None] * inv[None]
    cos = ang.cos().to(x.dtype)[None, :, None, :]
    sin = ang.sin().to(x.dtype)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, dim, n_heads, theta):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.theta = theta
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("m_kstorage", torch.zeros(MAX_BATCH, MAX_CTX, n_heads, self.head_dim), persistent=False)
        self.register_buffer("m_vstorage", torch.zeros(MAX_BATCH, MAX_CTX, n_heads, self.head_dim), persistent=False)
        self.m_past = 0

    def reset_ctx(self):
        self.m_kstorage.zero_()
        self.m_vstorage.zero_()
        self.m_past = 0

    def forward(self, x, use_cache=False):
        b, s, dim = x.shape
        past = self.m_past if use_cache else 0
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim)
        positions = torch.arange(past, past + s, device=x.device)
        q = rope_mode0(q, positions, self.theta)
        k = rope_mode0(k, positions, self.theta)
        if use_cache:
            if self.m_kstorage.dtype != x.dtype:
                self.m_kstorage = self.m_kstorage.to(x.dtype)
                self.m_vstorage = self.m_vstorage.to(x.dtype)
            if past == 0:  # prompt (context) branch: in place
                self.m_kstorage[:b, past : past + s] = k
                self.m_vstorage[:b, past : past + s] = v
            else:  # decode branch (m_past > 0): "output" tensor
                kdst = self.m_kstorage.clone()
                vdst = self.m_vstorage.clone()
                kdst[:b, past : past + s] = k
                vdst[:b, past : past + s] = v
            keys = self.m_kstorage[:b, : past + s]
            values = self.m_vstorage[:b, : past + s]
            self.m_past = past + s
        else:
            keys, values = k, v
        total = past + s
        scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) / math.sqrt(self.head_dim)
        mask = torch.ones(s, total, dtype=torch.bool, device=x.device).tril(diagonal=past)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, values).reshape(b, s, dim)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = LlamaAttention(cfg.dim, cfg.n_heads, cfg.theta)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden)

    def forward(self, x, use_cache):
        h = x + self.attention(self.attention_norm(x), use_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class InferLLMLlama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([LlamaLayer(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def reset_kv_cache(self):
        for layer in self.layers:
            layer.attention.reset_ctx()

    def forward(self, tokens, use_cache=False):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, use_cache)
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(2211)
    cfg = SimpleNamespace(vocab=96, dim=64, n_heads=4, hidden=160, n_layers=3, theta=10000.0)
    model = InferLLMLlama(cfg)
    g = torch.Generator().manual_seed(22111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
