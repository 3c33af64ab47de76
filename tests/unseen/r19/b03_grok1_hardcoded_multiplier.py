"""xai-org/grok-1 `MultiHeadAttention` (model.py, Haiku) ported to torch: separate bias-free
`query`/`key`/`value` projections, Grok's own `RotaryEmbedding` (phase tiled to both halves, rotate_half
on `jnp.split(x, 2)`), the query reshaped to `(..., kv_heads, heads_per_kv, key_size)` so grouped-query
attention is one einsum `...thHd,...Thd->...hHtT` without repeating keys, `attn_output_multiplier`
scaling, `where(mask, logits, -1e30)`, and the `linear` output projection. The model body builds the
boolean causal mask (`tril`) and combines it with a padding mask.

This file: one bug: attn_output_multiplier keeps the released model's 0.08838834764831845 (1/sqrt(128)) while key_size is 8 (expected 1/sqrt(8))."""

import math

import torch
from torch import nn


class TransformerConfig:
    emb_size = 64
    num_q_heads = 8
    num_kv_heads = 2
    key_size = 8
    attn_output_multiplier = 0.08838834764831845  # copied from the 314B config (key_size 128)
    rope_base_exponent = 10000


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Grok-1 RotaryEmbedding: phase = t * inv_freq, tiled to (.., 2 * half) and applied per head."""

    def __init__(self, dim, base_exponent=10000):
        super().__init__()
        assert dim % 2 == 0
        self.dim = dim
        self.base_exponent = base_exponent

    def forward(self, x, seq_dim, offset=0):
        fprop_dtype = x.dtype
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float64)
        inv_freq = 1.0 / (self.base_exponent ** (exponents / self.dim))
        t = torch.arange(x.shape[seq_dim], dtype=torch.float64) + offset
        phase = torch.einsum("bi,j->bij", t[None, :], inv_freq)
        phase = torch.tile(phase, (1, 1, 2))[:, :, None, :]
        return x * torch.cos(phase).to(fprop_dtype) + rotate_half(x) * torch.sin(phase).to(fprop_dtype)


class MultiHeadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_q_heads = config.num_q_heads
        self.num_kv_heads = config.num_kv_heads
        self.key_size = config.key_size
        self.attn_output_multiplier = config.attn_output_multiplier
        self.query = nn.Linear(config.emb_size, self.num_q_heads * self.key_size, bias=False)
        self.key = nn.Linear(config.emb_size, self.num_kv_heads * self.key_size, bias=False)
        self.value = nn.Linear(config.emb_size, self.num_kv_heads * self.key_size, bias=False)
        self.linear = nn.Linear(self.num_q_heads * self.key_size, config.emb_size, bias=False)
        self.rotary = RotaryEmbedding(self.key_size, base_exponent=config.rope_base_exponent)

    def forward(self, query, mask):
        b, t, _ = query.shape
        query_heads = self.query(query).view(b, t, self.num_q_heads, self.key_size)
        key_heads = self.key(query).view(b, t, self.num_kv_heads, self.key_size)
        value_heads = self.value(query).view(b, t, self.num_kv_heads, self.key_size)

        key_heads = self.rotary(key_heads, seq_dim=1, offset=0)
        query_heads = self.rotary(query_heads, seq_dim=1, offset=0)

        group = self.num_q_heads // self.num_kv_heads
        query_heads = query_heads.view(b, t, self.num_kv_heads, group, self.key_size)
        attn_logits = torch.einsum("bthHd,bThd->bhHtT", query_heads, key_heads)
        attn_logits = attn_logits * self.attn_output_multiplier

        mask = mask[:, :, None, :, :]  # (b, 1, 1, t, T): broadcast over kv heads and groups
        attn_logits = torch.where(mask, attn_logits, torch.full_like(attn_logits, -1e30))
        attn_weights = torch.softmax(attn_logits, dim=-1)

        attn = torch.einsum("bhHtT,bThd->bthHd", attn_weights, value_heads)

        attn = attn.reshape(b, t, self.num_q_heads * self.key_size)
        return self.linear(attn)


class Transformer(nn.Module):
    """Grok's Transformer body, reduced to the attention: builds the causal mask from the padding mask."""

    def __init__(self, config):
        super().__init__()
        self.attn = MultiHeadAttention(config)

    def forward(self, embeddings):
        b, t, _ = embeddings.shape
        padding_mask = torch.ones(b, t, dtype=torch.bool, device=embeddings.device)
        mask = padding_mask[:, None, None, :]  # (b, 1, 1, T)
        causal_mask = torch.tril(torch.ones(1, 1, t, t, dtype=torch.bool, device=embeddings.device))
        mask = torch.logical_and(mask, causal_mask)
        return self.attn(embeddings, mask)


def make_grok1_gqa():
    torch.manual_seed(1913)
    return Transformer(TransformerConfig()).eval()


EXPECT = {'target': 'make_grok1_gqa',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'attn',
 'stage': 'scaled_scores',
 'mistake': 'wrong_scale',
 'style': 'Grok-1 MultiHeadAttention (torch port): attn_output_multiplier kept at the released '
          '0.0883883 (1/sqrt(128)) with key_size 8'}
