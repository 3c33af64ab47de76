"""A torch port of Equinox's `eqx.nn.MultiheadAttention` (patrick-kidger/equinox), written the way
Equinox code runs: the layer works on ONE example of shape (seq, size) and the caller vmaps it over
the batch (here a loop over the batch); projections are applied per token (`jax.vmap(linear)`),
heads come from `reshape(seq, num_heads, -1)`, an optional `process_heads(q, k, v)` hook runs before
the core, the core `dot_product_attention` is vmapped over the head axis (`in_axes=1, out_axes=1`,
here a loop and a `stack(dim=1)`), divides the query by sqrt(qk_size), uses `jnp.where(mask, logits,
finfo.min)` when a mask is given, and the heads are merged with `reshape(seq, -1)`. The hook is used
as Equinox's documentation shows, with `eqx.nn.RotaryPositionalEmbedding` (halves, `theta`) vmapped
over heads, and with an `eqx.nn.LayerNorm(qk_size)` QK norm vmapped over tokens and heads.

This file: one bug: the cos/sin tables are laid out for interleaved pairs (`jnp.repeat(freqs, 2)` ported as repeat_interleave) while the rotation is rotate_half (halves): not a rotation"""

import math
import torch
from torch import nn


class Linear(nn.Module):
    """eqx.nn.Linear: weight (out, in), optional bias, called on a single vector (vmapped here)."""

    def __init__(self, in_features, out_features, use_bias):
        super().__init__()
        lim = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features).uniform_(-lim, lim))
        self.bias = nn.Parameter(torch.empty(out_features).uniform_(-lim, lim)) if use_bias else None

    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class LayerNorm(nn.Module):
    """eqx.nn.LayerNorm(shape, eps=1e-5) over the last axis of one vector."""

    def __init__(self, shape, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class RotaryPositionalEmbedding(nn.Module):
    """eqx.nn.RotaryPositionalEmbedding(embedding_size, theta): applied to one (seq, embedding_size)."""

    def __init__(self, embedding_size, theta=10000.0):
        super().__init__()
        self.embedding_size = embedding_size
        self.theta = theta

    @staticmethod
    def rotate_half(x):
        d_2 = x.shape[-1] // 2
        return torch.cat([-x[..., d_2:], x[..., :d_2]], dim=-1)

    def forward(self, x):
        seq_len, embedding_size = x.shape
        freqs = 1.0 / (
            self.theta
            ** (torch.arange(0.0, embedding_size, 2, dtype=torch.float64)[: embedding_size // 2] / embedding_size)
        )
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.outer(t, freqs)
        freqs_cos = torch.repeat_interleave(torch.cos(freqs), 2, dim=-1)
        freqs_sin = torch.repeat_interleave(torch.sin(freqs), 2, dim=-1)
        return (x * freqs_cos.to(x.dtype) + self.rotate_half(x) * freqs_sin.to(x.dtype))


def dot_product_attention_weights(query, key, mask=None):
    query = query / math.sqrt(query.shape[-1])
    logits = query @ key.T
    if mask is not None:
        logits = torch.where(mask, logits, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=-1)


def dot_product_attention(query, key_, value, mask=None):
    weights = dot_product_attention_weights(query, key_, mask)
    return weights @ value


class MultiheadAttention(nn.Module):
    def __init__(self, num_heads, query_size, key_size=None, value_size=None, output_size=None,
                 qk_size=None, vo_size=None, use_query_bias=False, use_key_bias=False,
                 use_value_bias=False, use_output_bias=False):
        super().__init__()
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        output_size = query_size if output_size is None else output_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        self.num_heads = num_heads
        self.qk_size = qk_size
        self.vo_size = vo_size
        self.query_proj = Linear(query_size, num_heads * qk_size, use_query_bias)
        self.key_proj = Linear(key_size, num_heads * qk_size, use_key_bias)
        self.value_proj = Linear(value_size, num_heads * vo_size, use_value_bias)
        self.output_proj = Linear(num_heads * vo_size, output_size, use_output_bias)

    def _project(self, proj, x):
        seq_length, _ = x.shape
        projection = proj(x)
        return projection.reshape(seq_length, self.num_heads, -1)

    def forward(self, query, key_, value, mask=None, process_heads=None):
        query_seq_length, _ = query.shape
        query_heads = self._project(self.query_proj, query)
        key_heads = self._project(self.key_proj, key_)
        value_heads = self._project(self.value_proj, value)
        if process_heads is not None:
            query_heads, key_heads, value_heads = process_heads(query_heads, key_heads, value_heads)
        per_head = [
            dot_product_attention(query_heads[:, h], key_heads[:, h], value_heads[:, h], mask)
            for h in range(self.num_heads)
        ]
        attn = torch.stack(per_head, dim=1)
        attn = attn.reshape(query_seq_length, -1)
        return self.output_proj(attn)


class EncoderBlock(nn.Module):
    """A bidirectional block as in Equinox's docs: the attention gets a process_heads hook."""

    def __init__(self, qk_norm=False):
        super().__init__()
        self.attn = MultiheadAttention(num_heads=4, query_size=64)
        self.rope = RotaryPositionalEmbedding(embedding_size=16, theta=10000.0)
        if qk_norm:
            self.q_norm = LayerNorm(16)
            self.k_norm = LayerNorm(16)
        else:
            self.q_norm = self.k_norm = None

    def process_heads(self, query_heads, key_heads, value_heads):
        query_heads = per_head(self.rope, query_heads)
        key_heads = per_head(self.rope, key_heads)
        return query_heads, key_heads, value_heads

    def forward(self, x):
        outs = [self.attn(xb, xb, xb, process_heads=self.process_heads) for xb in x.unbind(0)]
        return torch.stack(outs, dim=0)


def per_head(fn, heads):
    # jax.vmap(fn, in_axes=1, out_axes=1)
    return torch.stack([fn(heads[:, h]) for h in range(heads.shape[1])], dim=1)


def make_eqx_encoder():
    torch.manual_seed(1753)
    block = EncoderBlock(qk_norm=False)
    with torch.no_grad():
        for norm in (block.q_norm, block.k_norm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.3, 0.3)
    return block.eval()


EXPECT = {'target': 'make_eqx_encoder',
 'kind': 'multihead',
 'ok': False,
 'layer': 'attn',
 'stage': 'rotated_queries',
 'mistake': 'rope_pairing',
 'style': 'Equinox MultiheadAttention port: one bug: the cos/sin tables are laid out for '
          'interleaved pairs (`jnp.repeat(freqs, 2)` ported as repeat_interleave) while the '
          'rotation is rotate_half (halves): not a rotation'}
