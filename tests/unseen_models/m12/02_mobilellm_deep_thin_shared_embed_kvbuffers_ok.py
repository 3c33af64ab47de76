"""MobileLLM (facebookresearch/MobileLLM) deep-and-thin llama variant with an inference buffer cache.

MobileLLMModel: `tok_embeddings` shared with the output head (embedding sharing, `output` has no weight
of its own), deep-thin stack `blocks.N` (six blocks, d 48), each block pre-norm `attn_norm` /
`ffn_norm`, `attn` with to_q/to_k/to_v/to_o (no bias), GQA 6/2 (heads of 8) via repeat_interleave,
rotate-half rotary base 1e4 from a precomputed `rope_cos`/`rope_sin` buffer table (128 rows), SwiGLU.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok,
use_cache=True)`; each `attn` grows `cache_k`/`cache_v` (b, kv, s, d) by torch.cat and
`model.current_pos` offsets the rotary rows; the causal mask is a `-inf` triu buffer sliced at
[current_pos : current_pos + n, : current_pos + n].  `model(ids)` is the full forward.  Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["blocks.%d.attn" % i for i in range(6)],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "MobileLLM deep-thin: shared tok_embeddings/output, 6 blocks d 48, GQA 6/2 repeat_interleave, rope_cos/"
    "rope_sin buffer tables, growing cache_k/cache_v + current_pos, -inf triu mask buffer sliced",
}


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.scale * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class GroupedAttention(nn.Module):
    def __init__(self, d, n_head, n_kv):
        super().__init__()
        self.n_head, self.n_kv, self.hd = n_head, n_kv, d // n_head
        self.to_q = nn.Linear(d, d, bias=False)
        self.to_k = nn.Linear(d, n_kv * self.hd, bias=False)
        self.to_v = nn.Linear(d, n_kv * self.hd, bias=False)
        self.to_o = nn.Linear(d, d, bias=False)
        self.cache_k = None
        self.cache_v = None

    @staticmethod
    def _rot(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    def forward(self, x, cos, sin, mask, use_cache=False):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.n_head, self.hd).transpose(1, 2)
        k = self.to_k(x).view(b, n, self.n_kv, self.hd).transpose(1, 2)
        v = self.to_v(x).view(b, n, self.n_kv, self.hd).transpose(1, 2)
        q, k = self._rot(q, cos, sin), self._rot(k, cos, sin)
        if use_cache:
            if self.cache_k is not None:
                k = torch.cat([self.cache_k, k], 2)
                v = torch.cat([self.cache_v, v], 2)
            self.cache_k, self.cache_v = k, v
        rep = self.n_head // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-2, -1)) / self.hd ** 0.5 + mask
        att = att.softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, n, -1)
        return self.to_o(y)

    def reset_cache(self):
        self.cache_k = self.cache_v = None


class Block(nn.Module):
    def __init__(self, d, n_head, n_kv, hidden):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = GroupedAttention(d, n_head, n_kv)
        self.ffn_norm = RMSNorm(d)
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin, mask, use_cache):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, use_cache)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class MobileLLMModel(nn.Module):
    def __init__(self, vocab=96, d=48, n_layer=6, n_head=6, n_kv=2, hidden=96, max_len=128, base=10000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, n_head, n_kv, hidden) for _ in range(n_layer)])
        self.norm = RMSNorm(d)
        hd = d // n_head
        inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], -1)
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)
        self.register_buffer("causal", torch.triu(torch.full((max_len, max_len), float("-inf")), 1), persistent=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        for blk in self.blocks:
            blk.attn.reset_cache()
        self.current_pos = 0

    def forward(self, idx, use_cache=False):
        b, n = idx.shape
        p = self.current_pos if use_cache else 0
        x = self.tok_embeddings(idx)
        cos = self.rope_cos[p:p + n].to(x.dtype)
        sin = self.rope_sin[p:p + n].to(x.dtype)
        mask = self.causal[p:p + n, :p + n].to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask, use_cache)
        if use_cache:
            self.current_pos += n
        return F.linear(self.norm(x), self.tok_embeddings.weight)


def make_model():
    torch.manual_seed(1202)
    model = MobileLLMModel()
    g = torch.Generator().manual_seed(12021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()
