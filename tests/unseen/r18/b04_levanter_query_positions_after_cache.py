"""levanter (Stanford CRFM, JAX + Haliax named axes) LlamaAttention, ported to torch.

Haliax names every axis; here each named rearrange becomes a view/permute and each `hax.dot` an einsum
with the axis names spelled out. Queries carry ("kv_heads", "q_heads_per_group", "position",
"head_size"), keys/values ("kv_heads", "key_position", "head_size"), so GQA needs no repeat. The
rotary is levanter's `llama_rotary_pos_emb` (rotate_half halves, float64 tables), the query is divided
by sqrt(head_size) before the dot, and the model builds the boolean `AttentionMask.causal(sliding_window)`.

This file: one bug: the queries are rotated at decode-style positions key_len + arange(n) while the keys use 0..n-1."""

import math

import torch
from torch import nn


class LlamaConfig:
    hidden_dim = 64
    num_heads = 4
    num_kv_heads = 2
    rope_theta = 500000.0
    sliding_window = None
    layer_norm_epsilon = 1e-5


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama_rotary_pos_emb(head_size, positions, base, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def causal_attention_mask(q_pos, k_pos, sliding_window=None):
    """haliax AttentionMask.causal(sliding_window=...) materialised over (position, key_position)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    return allowed


def dot_product_attention(query, key, value, mask):
    # query: (batch, kv_heads, q_heads_per_group, position, head_size)
    # key/value: (batch, kv_heads, key_position, head_size)
    query = query / math.sqrt(query.shape[-1])
    logits = torch.einsum("bkgpd,bksd->bkgps", query, key)
    logits = torch.where(mask, logits, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1)
    return torch.einsum("bkgps,bksd->bkgpd", weights, value)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_size = config.hidden_dim // config.num_heads
        self.q_heads_per_group = config.num_heads // config.num_kv_heads
        d, hs = config.hidden_dim, self.head_size
        self.q_proj = nn.Linear(d, config.num_heads * hs, bias=False)
        self.k_proj = nn.Linear(d, config.num_kv_heads * hs, bias=False)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hs, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hs, d, bias=False)

    def forward(self, x, mask, position_ids):
        b, n, _ = x.shape
        kvh, g, hs = self.config.num_kv_heads, self.q_heads_per_group, self.head_size
        q = self.q_proj(x).view(b, n, kvh, g, hs).permute(0, 2, 3, 1, 4)
        k = self.k_proj(x).view(b, n, kvh, hs).permute(0, 2, 1, 3)
        v = self.v_proj(x).view(b, n, kvh, hs).permute(0, 2, 1, 3)

        cos, sin = llama_rotary_pos_emb(hs, position_ids, self.config.rope_theta, x.dtype)
        q_cos, q_sin = llama_rotary_pos_emb(hs, position_ids + k.shape[2], self.config.rope_theta, x.dtype)
        q = q * q_cos + rotate_half(q) * q_sin
        k = k * cos + rotate_half(k) * sin

        attn = dot_product_attention(q, k, v, mask)
        attn = attn.permute(0, 3, 1, 2, 4).reshape(b, n, -1)  # flatten (kv_heads, q_heads_per_group)
        return self.o_proj(attn)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_dim, config.layer_norm_epsilon)
        self.self_attn = LlamaAttention(config)

    def forward(self, x, mask, position_ids):
        return x + self.self_attn(self.input_layernorm(x), mask, position_ids)


class LlamaTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([LlamaDecoderLayer(config)])
        self.norm = LlamaRMSNorm(config.hidden_dim, config.layer_norm_epsilon)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        mask = causal_attention_mask(pos, pos, self.config.sliding_window)
        for layer in self.layers:
            x = layer(x, mask, pos)
        return self.norm(x)


def make_levanter_llama():
    torch.manual_seed(1806)
    model = LlamaTransformer(LlamaConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_levanter_llama',
 'kind': 'causal-multihead',
 'layer': 'layers.0.self_attn',
 'ok': False,
 'stage': 'rotated_queries',
 'mistake': 'rope_positions',
 'style': 'levanter GQA: query rotary tables built for position_ids + key_len (as if the queries '
          'followed a cache), keys at 0..n-1'}
