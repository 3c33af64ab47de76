"""gpt-fast (pytorch-labs) style attention whose forward requires a KVCache object and
input_pos: keys/values are written into a static (max_batch, heads, max_seq, dim) cache
and attention runs over the whole cache buffer with a mask indexed by input_pos.  The
wrapper allocates the cache (setup_caches) on every call.  A forward that depends on a
cache object: should be refused.
"""

import torch
import torch.nn.functional as F
from torch import nn


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos, k_val, v_val):
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


def apply_rotary_emb(x, freqs_cis):
    xs = x.reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack(
        [
            xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
            xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1],
        ],
        -1,
    )
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim=64, n_head=4, n_local_heads=2):
        super().__init__()
        self.dim, self.n_head, self.n_local_heads = dim, n_head, n_local_heads
        self.head_dim = dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_local_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = None

    def forward(self, x, freqs_cis, mask, input_pos):
        if self.kv_cache is None:
            raise RuntimeError("call setup_caches() first")
        bsz, seqlen, _ = x.shape
        kv = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv, kv], dim=-1)
        q = apply_rotary_emb(q.view(bsz, seqlen, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(bsz, seqlen, self.n_local_heads, self.head_dim), freqs_cis)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class CachedBlock(nn.Module):
    def __init__(self, max_seq_length=64):
        super().__init__()
        self.attention = Attention()
        self.max_seq_length = max_seq_length
        hd = self.attention.head_dim
        freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).double() / hd))
        ang = torch.outer(torch.arange(max_seq_length).double(), freqs)
        self.register_buffer("freqs_cis", torch.stack([ang.cos(), ang.sin()], -1), persistent=False)
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool)),
            persistent=False,
        )

    def setup_caches(self, max_batch_size, dtype):
        self.attention.kv_cache = KVCache(
            max_batch_size,
            self.max_seq_length,
            self.attention.n_local_heads,
            self.attention.head_dim,
            dtype,
        )

    def forward(self, x):
        self.setup_caches(x.shape[0], x.dtype)
        input_pos = torch.arange(x.shape[1])
        mask = self.causal_mask[None, None, input_pos]
        return x + self.attention(x, self.freqs_cis[input_pos].to(x.dtype), mask, input_pos)


def make_cached_block():
    torch.manual_seed(203)
    return CachedBlock()


EXPECT = {
    "target": "make_cached_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attention",
    "unsupported": "kv_cache",
    "style": "pytorch-labs gpt-fast Attention with a required KVCache (static max_seq buffers) and input_pos; keys "
    "are read from the whole cache with an input_pos-indexed mask; expected to be refused",
}
