"""pytorch/torchchat model.py Transformer, reduced and made self-contained.

Transformer: tok_embeddings, layers.N = TransformerBlock(attention, feed_forward, attention_norm, ffn_norm),
norm, output.  Attention: fused `wqkv` (q | k | v sized by n_head and n_local_heads), `wo`, GQA 4/2 with
repeat_interleave on the head axis, freqs_cis held as a real (seq, hd/2, 2) cos/sin table applied to
adjacent pairs (interleaved pairing), base 5e5, SDPA with an explicit boolean mask sliced from
`causal_mask` by input_pos.  KVCache: per-attention `k_cache`/`v_cache` buffers (b, kv, 64, d) written
with index assignment at input_pos.
Cache: book-buffers. `model(prompt, start_pos=0)`, `model(tok, start_pos=L)`; or `model.reset_kv_cache()`,
`model(prompt, use_cache=True)`, `model(tok, use_cache=True)`.  `model(ids)` with neither touches no
cache.  Returns logits.  Buffers hold batch <= 4 and 64 positions.  Correct.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "torchchat model.py: fused wqkv split by sizes, KVCache buffers indexed by input_pos, real-valued "
    "freqs_cis on adjacent pairs, GQA 4/2 repeat_interleave, SDPA with sliced boolean causal_mask",
}

MAX_BATCH, MAX_SEQ = 4, 64


class KVCache(nn.Module):
    def __init__(self, n_heads, head_dim):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(MAX_BATCH, n_heads, MAX_SEQ, head_dim), persistent=False)
        self.register_buffer("v_cache", torch.zeros(MAX_BATCH, n_heads, MAX_SEQ, head_dim), persistent=False)

    def update(self, input_pos, k_val, v_val):
        b = k_val.shape[0]
        self.k_cache[:b, :, input_pos] = k_val.to(self.k_cache.dtype)
        self.v_cache[:b, :, input_pos] = v_val.to(self.v_cache.dtype)
        end = int(input_pos[-1]) + 1
        return self.k_cache[:b, :, :end], self.v_cache[:b, :, :end]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(n_elem, seq_len, base):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem))
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1)


def apply_rotary_emb(x, freqs_cis):
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2).to(x.dtype)
    out = torch.stack([
        xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
        xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
    ], -1)
    return out.flatten(3)


class Attention(nn.Module):
    def __init__(self, dim, n_head, n_local_heads):
        super().__init__()
        self.n_head, self.n_local_heads = n_head, n_local_heads
        self.head_dim = dim // n_head
        total = (n_head + 2 * n_local_heads) * self.head_dim
        self.wqkv = nn.Linear(dim, total, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = None
        self.dim = dim

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None and input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        rep = self.n_head // self.n_local_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_head, n_local_heads):
        super().__init__()
        self.attention = Attention(dim, n_head, n_local_heads)
        self.feed_forward = FeedForward(dim, 160)
        self.ffn_norm = RMSNorm(dim)
        self.attention_norm = RMSNorm(dim)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab_size=96, dim=64, n_layer=3, n_head=4, n_local_heads=2, rope_base=500000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_head, n_local_heads) for _ in range(n_layer))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.head_dim = dim // n_head
        self.rope_base = rope_base
        self.register_buffer("causal_mask", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)),
                             persistent=False)
        self.setup_caches(n_local_heads)
        self._pos = 0

    def setup_caches(self, n_local_heads):
        for b in self.layers:
            b.attention.kv_cache = KVCache(n_local_heads, self.head_dim)

    def reset_kv_cache(self):
        self._pos = 0
        for b in self.layers:
            b.attention.kv_cache.k_cache.zero_()
            b.attention.kv_cache.v_cache.zero_()

    def forward(self, idx, start_pos=None, use_cache=False):
        seqlen = idx.shape[1]
        if start_pos is None and use_cache:
            start_pos = self._pos
        if start_pos is not None:
            input_pos = torch.arange(start_pos, start_pos + seqlen, device=idx.device)
            self._pos = start_pos + seqlen
            mask = self.causal_mask[None, None, input_pos, : start_pos + seqlen]
        else:
            input_pos = None
            mask = self.causal_mask[None, None, :seqlen, :seqlen]
        offset = 0 if start_pos is None else start_pos
        freqs_cis = precompute_freqs_cis(self.head_dim, MAX_SEQ, self.rope_base)[offset: offset + seqlen]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def make_model():
    torch.manual_seed(1302)
    model = Transformer()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()
