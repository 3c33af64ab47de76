"""Praxis / Pax style (google/praxis, praxis/layers/attentions.py and grouped_query_attention.py) ported
from Flax to torch: per-projection weights shaped [D, N, H] applied with einsum('BTD,DNH->BTNH'),
RotaryPositionalEmbedding with min/max timescale (first half / second half of each head), _scale_query
by 1/sqrt(dim_per_head), logits in BNTS, the attention mask as a large negative number
(py_utils.get_large_negative_number) added to the logits, softmax over S, einsum back and a post
projection w_post [D, N, H]. Here the GroupedQueryAttention layer (MQA, one kv head) inside a causal Transformer layer.

This file: correct (MQA 4:1, halves rotary max_timescale 10000, causal)"""

import math

import torch
from torch import nn


def large_negative_number(dtype):
    return -0.7 * torch.finfo(dtype).max


class AttentionProjection(nn.Module):
    def __init__(self, input_dim, num_heads, dim_per_head, is_output_projection=False, use_bias=True):
        super().__init__()
        self.is_output_projection = is_output_projection
        self.w = nn.Parameter(torch.randn(input_dim, num_heads, dim_per_head) * input_dim**-0.5)
        self.b = nn.Parameter(torch.randn(input_dim if is_output_projection else num_heads * dim_per_head).view(
            (input_dim,) if is_output_projection else (num_heads, dim_per_head)) * 0.1) if use_bias else None

    def forward(self, x):
        if self.is_output_projection:
            out = torch.einsum("BTNH,DNH->BTD", x, self.w)
        else:
            out = torch.einsum("BTD,DNH->BTNH", x, self.w)
        return out + self.b if self.b is not None else out


class RotaryPositionalEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10000):
        super().__init__()
        self.embedding_dims = embedding_dims
        self.min_timescale = min_timescale
        self.max_timescale = max_timescale

    def forward(self, inputs, position):
        half = self.embedding_dims // 2
        fraction = 2 * torch.arange(half, dtype=torch.float64) / self.embedding_dims
        timescale = self.min_timescale * (self.max_timescale / self.min_timescale) ** fraction
        sinusoid = (position.to(torch.float64)[:, None] / timescale[None, :])[None, :, None, :]
        sin, cos = torch.sin(sinusoid).to(inputs.dtype), torch.cos(sinusoid).to(inputs.dtype)
        first, second = torch.split(inputs, half, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class GroupedQueryAttention(nn.Module):
    def __init__(self, input_dim=64, num_heads=4, num_kv_heads=1, dim_per_head=16, use_rotary=True):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.dim_per_head = dim_per_head
        self.query = AttentionProjection(input_dim, num_heads, dim_per_head)
        self.key = AttentionProjection(input_dim, num_kv_heads, dim_per_head)
        self.value = AttentionProjection(input_dim, num_kv_heads, dim_per_head)
        self.post = AttentionProjection(input_dim, num_heads, dim_per_head, is_output_projection=True)
        self.rotary_position_emb = RotaryPositionalEmbedding(dim_per_head) if use_rotary else None

    def _scale_query(self, query):
        return query * (1.0 / math.sqrt(self.dim_per_head))

    def forward(self, query_vec, key_vec=None):
        key_vec = query_vec if key_vec is None else key_vec
        t, s = query_vec.shape[1], key_vec.shape[1]
        query = self.query(query_vec)
        key = self.key(key_vec)
        value = self.value(key_vec)
        if self.rotary_position_emb is not None:
            query = self.rotary_position_emb(query, torch.arange(t, device=query.device))
            key = self.rotary_position_emb(key, torch.arange(s, device=key.device))
        query = self._scale_query(query)
        b, _, n, h = query.shape
        g = self.num_heads // self.num_kv_heads
        query = query.reshape(b, t, self.num_kv_heads, g, h)
        logits = torch.einsum("BTKGH,BSKH->BKGTS", query, key)
        if True:
            causal = torch.ones(t, s, dtype=torch.bool, device=logits.device).triu(1)
            logits = logits + causal.to(logits.dtype) * large_negative_number(logits.dtype)
        probs = torch.softmax(logits, dim=-1)
        encoded = torch.einsum("BKGTS,BSKH->BTKGH", probs, value).reshape(b, t, self.num_heads, h)
        return self.post(encoded)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_norm = nn.LayerNorm(64)
        self.self_attention = GroupedQueryAttention()

    def forward(self, inputs):
        return inputs + self.self_attention(self.layer_norm(inputs))


def make_praxis_mqa():
    torch.manual_seed(2051)
    model = Transformer()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.6, 1.4)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_praxis_mqa',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'self_attention',
 'structure': {'heads': 4,
               'kv_heads': 1,
               'head_dim': 16,
               'causal': True,
               'cross': False,
               'rope': {'pairing': 'half', 'fraction': 1.0, 'base': 10000},
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'Praxis attentions.py / grouped_query_attention.py: correct (MQA 4:1, halves rotary '
          'max_timescale 10000, causal)'}
