"""Meta's reference Llama style: ``forward(tokens, start_pos)``, caches preallocated in buffers.

Each attention layer writes its new keys and values into ``cache_k``/``cache_v`` (zeros,
``max_seq`` long) at ``start_pos`` and attends over ``cache_k[:bsz, : start_pos + seqlen]``;
the caller keeps the position. An additive mask for prompts, none for one-token steps; the
forward runs in ``torch.inference_mode`` (the checker runs it without).
(Learned positions offset by ``start_pos`` stand in for the rotary embedding.) Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "kind": "model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention"],
    "decode": "ok",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, n_heads, max_batch, max_seq):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer(
            "cache_k", torch.zeros(max_batch, max_seq, n_heads, self.head_dim), persistent=False
        )
        self.register_buffer(
            "cache_v", torch.zeros(max_batch, max_seq, n_heads, self.head_dim), persistent=False
        )

    def forward(self, x, start_pos, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, : start_pos + seqlen]
        values = self.cache_v[:bsz, : start_pos + seqlen]
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, mb, ms):
        super().__init__()
        self.attention = Attention(dim, heads, mb, ms)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.feed_forward = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)
        )

    def forward(self, x, start_pos, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, n_layers=2, max_batch=4, max_seq=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads, max_batch, max_seq) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    @torch.inference_mode()
    def forward(self, tokens, start_pos: int):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens) + self.pos(torch.arange(start_pos, start_pos + seqlen))
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"))
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos)), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, mask)
        return self.output(self.norm(h)).float()


def make_model():
    torch.manual_seed(0)
    return Transformer()
