"""ai-edge-torch generative DecoderOnlyModel (google-ai-edge/ai-edge-torch, ai_edge_torch/generative),
rewritten in plain torch.  tok_embedding, transformer_blocks.N (TransformerBlock: pre_atten_norm,
atten_func = CausalSelfAttention, post_atten_norm, ff), final_norm, lm_head.  CausalSelfAttention has one
fused `qkv_projection` laid out per query group ((q_per_kv + 2) * head_dim per group: q heads, then k, then
v), `output_projection`; rotary applied inline from input_pos (apply_rope_inline, halves pairing, tables
computed in float64 at call time); `sdpa.scaled_dot_product_attention` repeat_interleaves k/v per group
and calls F.scaled_dot_product_attention with `is_causal=mask is None`.  Masks come from the model's
`mask_cache` (triu of -inf, kv_cache_max 64), rows selected with index_select(2, input_pos).
Cache: book-cache, `cache = mod.KVCache(n_layers=N)`, `model(prompt, cache=cache)`, then
`model(tok, cache=cache)`; each entry is a kv_utils KVCacheEntry (k_cache, v_cache) in BTNH layout
(batch, 64, groups, head_dim), written by `index_copy` at input_pos; attention reads all 64 slots.
`model(ids)` without a cache attends over its own tokens.  Returns the logits tensor.
4 blocks, multi-query (4 heads, 1 group), base 10000.
Slip: model configs are built per block (`block_config(idx)`, as for Gemma 3's local/global blocks); the
config for block 2 was copied from a model whose attention rotates interleaved pairs, so block 2 applies
`apply_rope_interleaved` to the halves-layout cos/sin tables from build_rope: the two members of a pair
are turned by different angles -- not a rotation.  Queries and keys alike, at their own positions, so
cached decoding still equals the full pass.
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {'target': 'make_model',
 'ok': False,
 'layers': ['transformer_blocks.0.atten_func',
            'transformer_blocks.1.atten_func',
            'transformer_blocks.2.atten_func',
            'transformer_blocks.3.atten_func'],
 'kind': 'causal-multihead',
 'cache': 'book-cache',
 'layer': 'transformer_blocks.2.atten_func',
 'stage': 'rotated_queries',
 'mistake': 'rope_pairing',
 'style': 'ai-edge-torch DecoderOnlyModel: transformer_blocks.N.atten_func, fused per-group '
          'qkv_projection, apply_rope_inline halves, static BTNH KVCacheEntry with index_copy, '
          'mask_cache rows by input_pos; MQA 4/1; block 2 applies the interleaved-pair rotation to '
          'halves tables'}


# ---- kv_utils ------------------------------------------------------------------------------
@dataclass
class KVCacheEntry:
    """One layer's static cache, layout BTNH: (batch, kv_cache_max, num_query_groups, head_dim)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def from_model_config(cls, batch_size, kv_cache_max, n_groups, head_dim, dtype, device):
        shape = (batch_size, kv_cache_max, n_groups, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


class KVCache:
    """A book cache holding one KVCacheEntry per transformer block (allocated on first use)."""

    def __init__(self, n_layers=4):
        self.n_layers = n_layers
        self.caches = [None] * n_layers
        self.num_tokens = 0

    def get(self, i):
        return self.caches[i]

    def update(self, i, entry):
        self.caches[i] = entry

    def seq_len(self):
        return self.num_tokens


def update(cache, input_pos, k_slice, v_slice):
    """kv_utils.update: writes k/v (B, T, G, H) at input_pos along the sequence axis."""
    k = cache.k_cache.index_copy(1, input_pos, k_slice.to(cache.k_cache.dtype))
    v = cache.v_cache.index_copy(1, input_pos, v_slice.to(cache.v_cache.dtype))
    return KVCacheEntry(k, v)


# ---- rotary_pos_emb --------------------------------------------------------------------------
def build_rope(input_pos, n_elem, base):
    """cos/sin (T, n_elem) for the halves layout: freqs repeated as [f, f]."""
    freq_exponent = torch.arange(0, n_elem, 2, dtype=torch.float64) / n_elem
    timescale = base**freq_exponent
    radians = input_pos.to(torch.float64)[:, None] / timescale[None, :]
    radians = torch.cat([radians, radians], dim=-1)
    return torch.cos(radians), torch.sin(radians)


def apply_rope(x, cos, sin):
    """x: (B, T, N, H); halves pairing (x[:H/2], x[H/2:])."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * c + rotated * s


def apply_rope_interleaved(x, cos, sin):
    """Pairs (x[2i], x[2i+1]) as complex numbers; the tables are read position by position."""
    xr = x.unflatten(-1, (-1, 2))
    a, b = xr[..., 0], xr[..., 1]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    ce, co = c[..., 0::2], c[..., 1::2]
    se, so = s[..., 0::2], s[..., 1::2]
    return torch.stack([a * ce - b * se, b * co + a * so], dim=-1).flatten(-2)


def apply_rope_inline(q, k, input_pos, n_elem, base, pairing="halves"):
    cos, sin = build_rope(input_pos, n_elem, base)
    fn = apply_rope if pairing == "halves" else apply_rope_interleaved
    return fn(q, cos, sin), fn(k, cos, sin)


# ---- layers ----------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return output * self.weight


def scaled_dot_product_attention(q, k, v, head_size, mask=None, scale=None):
    """sdpa.scaled_dot_product_attention: (B, T, N, H) in, (B, T, N*H) out."""
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    if q.size(1) != k.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=mask is None, scale=scale
    )
    B, N, T, H = y.shape
    return y.transpose(1, 2).reshape(B, T, N * H)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, config, block_config):
        super().__init__()
        self.config = block_config.attn_config
        attn = self.config
        self.n_heads = attn.num_heads
        self.num_query_groups = attn.num_query_groups
        self.head_dim = attn.head_dim
        qkv_shape = (attn.num_heads + 2 * attn.num_query_groups) * attn.head_dim
        self.qkv_projection = nn.Linear(dim, qkv_shape, bias=attn.qkv_use_bias)
        self.output_projection = nn.Linear(attn.num_heads * attn.head_dim, dim, bias=attn.output_proj_use_bias)
        self.kv_cache_max = config.kv_cache_max_len

    def forward(self, x, input_pos, mask, kv_cache=None):
        B, T, E = x.size()
        qkv = self.qkv_projection(x)
        q_per_kv = self.n_heads // self.num_query_groups
        qkv = qkv.view(B, T, -1, (q_per_kv + 2) * self.head_dim)
        q, k, v = qkv.split((q_per_kv * self.head_dim, self.head_dim, self.head_dim), dim=-1)
        q = q.reshape(B, T, -1, self.head_dim)
        k = k.reshape(B, T, -1, self.head_dim)
        v = v.reshape(B, T, -1, self.head_dim)

        n_elem = int(self.config.rotary_percentage * self.head_dim)
        q, k = apply_rope_inline(q, k, input_pos, n_elem, self.config.rotary_base, self.config.rope_pairing)

        if kv_cache is not None:
            kv_cache = update(kv_cache, input_pos, k, v)
            k, v = kv_cache.k_cache, kv_cache.v_cache

        y = scaled_dot_product_attention(q, k, v, self.head_dim, mask=mask)
        return self.output_projection(y), kv_cache


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config, block_config):
        super().__init__()
        self.pre_atten_norm = RMSNorm(config.embedding_dim)
        self.atten_func = CausalSelfAttention(config.embedding_dim, config, block_config)
        self.post_atten_norm = RMSNorm(config.embedding_dim)
        self.ff = FeedForward(config.embedding_dim, block_config.intermediate_size)

    def forward(self, x, input_pos, mask, kv_cache=None):
        attn_out, kv = self.atten_func(self.pre_atten_norm(x), input_pos, mask, kv_cache)
        x = x + attn_out
        return x + self.ff(self.post_atten_norm(x)), kv


class DecoderOnlyModel(nn.Module):
    """ai_edge_torch.generative.utilities.model_builder.DecoderOnlyModel, torch only."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embedding = nn.Embedding(config.vocab_size, config.embedding_dim)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(config, config.block_config(idx)) for idx in range(config.num_layers)
        )
        self.final_norm = RMSNorm(config.embedding_dim)
        self.lm_head = nn.Linear(config.embedding_dim, config.vocab_size, bias=False)
        mask = torch.full((config.kv_cache_max_len, config.kv_cache_max_len), float("-inf"))
        self.register_buffer("mask_cache", torch.triu(mask, diagonal=1)[None, None], persistent=False)

    def reset_kv_cache(self):
        pass

    def forward(self, tokens, cache=None):
        B, T = tokens.shape
        start = cache.seq_len() if cache is not None else 0
        input_pos = torch.arange(start, start + T, device=tokens.device)
        x = self.tok_embedding(tokens)
        if cache is not None:
            mask = self.mask_cache.index_select(2, input_pos)[:, :, :, : self.config.kv_cache_max_len]
        else:
            mask = self.mask_cache[:, :, :T, :T]
        mask = mask.to(x.dtype)
        for i, block in enumerate(self.transformer_blocks):
            entry = None
            if cache is not None:
                entry = cache.get(i)
                if entry is None:
                    g = block.atten_func
                    entry = KVCacheEntry.from_model_config(
                        B, self.config.kv_cache_max_len, g.num_query_groups, g.head_dim, x.dtype, x.device
                    )
            x, entry = block(x, input_pos, mask, entry)
            if cache is not None:
                cache.update(i, entry)
        if cache is not None:
            cache.num_tokens = start + T
        return self.lm_head(self.final_norm(x))


def make_model():
    torch.manual_seed(2605)
    n_layers = 4

    def block_config(idx):
        attn = SimpleNamespace(
            num_heads=4, num_query_groups=1, head_dim=16, rotary_percentage=1.0,
            rotary_base=10000.0, qkv_use_bias=False, output_proj_use_bias=False,
            rope_pairing="interleaved" if idx == 2 else "halves",
        )
        return SimpleNamespace(attn_config=attn, intermediate_size=128)

    config = SimpleNamespace(
        vocab_size=96, embedding_dim=64, num_layers=n_layers, kv_cache_max_len=64, block_config=block_config
    )
    model = DecoderOnlyModel(config)
    g = torch.Generator().manual_seed(2605 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
