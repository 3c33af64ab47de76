"""A small Llama in the style of pytorch-labs/gpt-fast model.py: fused wqkv for GQA
(4 query heads, 2 kv heads), complex-style rotary (freqs_cis stored as (cos, sin) pairs,
adjacent pairs rotated), and a *static* preallocated KVCache per layer written with
index_copy_ at input_pos; the attention then runs over the whole buffer with the mask row
causal_mask[input_pos].  Adapted to the book-style interface: forward(idx, use_cache=False),
the model keeps current_pos and reset_kv_cache() rewinds it and zeroes the buffers.

Slip: the rotary table is sliced as freqs_cis[:T] (fine without a cache, where input_pos is
0..T-1) instead of freqs_cis[input_pos], so each decoded token is rotated as if it stood at
position 0 while it is written into the right cache slot and masked correctly.  The full
forward is right.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "layers.0.attention"},
    "style": "gpt-fast model.py (static KVCache.update(input_pos, k, v) with index_copy_, mask row "
    "causal_mask[input_pos], interleaved freqs_cis) behind forward(idx, use_cache) + reset_kv_cache(); "
    "slip: freqs_cis[:T] instead of freqs_cis[input_pos]",
}


@dataclass
class ModelArgs:
    block_size: int = 64
    vocab_size: int = 128
    n_layer: int = 3
    n_head: int = 4
    dim: int = 64
    intermediate_size: int = 172
    n_local_heads: int = 2
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self):
        return self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        assert input_pos.shape[0] == k_val.shape[2]
        B = k_val.shape[0]
        k_out = self.k_cache[:B]
        v_out = self.v_cache[:B]
        k_out.index_copy_(2, input_pos, k_val)
        v_out.index_copy_(2, input_pos, v_val)
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(
            torch.mean(x.float() * x.float(), dim=-1, keepdim=True) + self.eps
        )
        return out.type_as(x) * self.weight


def precompute_freqs_cis(seq_len, n_elem, base=10000.0):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)


def apply_rotary_emb(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)

        q, k, v = map(lambda t: t.transpose(1, 2), (q, k, v))

        if self.kv_cache is not None and input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config, max_batch_size=8):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(config.block_size, config.head_dim, config.rope_base),
            persistent=False,
        )
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool)),
            persistent=False,
        )
        self.max_batch_size = max_batch_size
        self.setup_caches(max_batch_size, config.block_size)
        self.current_pos = 0

    def setup_caches(self, max_batch_size, max_seq_length):
        for b in self.layers:
            b.attention.kv_cache = KVCache(
                max_batch_size, max_seq_length, self.config.n_local_heads, self.config.head_dim
            )

    def reset_kv_cache(self):
        self.current_pos = 0
        for b in self.layers:
            b.attention.kv_cache.k_cache.zero_()
            b.attention.kv_cache.v_cache.zero_()

    def forward(self, idx, use_cache=False):
        T = idx.shape[1]
        freqs_cis = self.freqs_cis[:T]
        if use_cache:
            input_pos = torch.arange(self.current_pos, self.current_pos + T, device=idx.device)
            self.current_pos += T
            mask = self.causal_mask[None, None, input_pos]
        else:
            input_pos = None
            mask = self.causal_mask[None, None, :T, :T]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def make_model():
    torch.manual_seed(17)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
