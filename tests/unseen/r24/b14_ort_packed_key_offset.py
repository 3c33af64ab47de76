"""ONNX Runtime `com.microsoft.GroupQueryAttention` contrib op (onnxruntime/contrib_ops/cpu/bert/
group_query_attention.cc and gqa_attention_base.h), its CPU-kernel semantics ported to torch inside a
small exported-decoder module: packed QKV input (`do_packed_qkv`), `seqlens_k` (total length - 1 per
sequence) and `total_sequence_length`, half-width `cos_cache` / `sin_cache` inputs with `do_rotary` and
`rotary_interleaved` (rotary_dim = 2 * cache width, the rest of each head passed through), the
`scale` attribute (0 = 1/sqrt(head_size)), `local_window_size` (a query sees itself plus
local_window_size keys to its left), query head h reading kv head h / (num_heads / kv_num_heads),
masked keys filled with the op's mask_filter_value (-10000) and a row-wise max-subtracted softmax.
The exporting model owns the projections (`qkv_proj`, `o_proj`) and builds the caches in float64.

This file: one bug: the packed QKV is sliced with the key offset at 0, so the keys are made from the first kv_size rows of the query projection (GQA 4:2, window 8)."""

import math

import torch
from torch import nn


class ExportConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    rotary_dim = 16
    rotary_interleaved = False
    sliding_window = 8
    max_position_embeddings = 128
    rms_norm_eps = 1e-6


def _expand_cache(cache, interleaved):
    """(S, rotary_dim / 2) -> (S, rotary_dim) laid out for the chosen pairing."""
    if interleaved:
        return cache.repeat_interleave(2, dim=-1)
    return torch.cat((cache, cache), dim=-1)


def _rotate(x, interleaved):
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(x, position_ids, cos_cache, sin_cache, interleaved):
    """x: (B, N, S, H); rotates the first 2 * cos_cache.shape[1] features of each head."""
    rotary_dim = 2 * cos_cache.shape[1]
    cos = _expand_cache(cos_cache[position_ids], interleaved)[:, None]  # (B, 1, S, rotary_dim)
    sin = _expand_cache(sin_cache[position_ids], interleaved)[:, None]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + _rotate(x_rot, interleaved) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


def group_query_attention(query, key, value, seqlens_k, total_sequence_length, cos_cache, sin_cache,
                          num_heads, kv_num_heads, scale=0.0, local_window_size=-1,
                          do_rotary=1, rotary_interleaved=0):
    """query: (B, S, (num_heads + 2 * kv_num_heads) * H) when key and value are None (packed QKV)."""
    batch, seq_len, _ = query.shape
    head_size = query.shape[-1] // (num_heads + 2 * kv_num_heads)
    q_size, kv_size = num_heads * head_size, kv_num_heads * head_size
    if key is None:
        packed = query
        query = packed[..., :q_size]
        key = packed[..., :kv_size]
        value = packed[..., q_size + kv_size :]
    q = query.view(batch, seq_len, num_heads, head_size).transpose(1, 2)
    k = key.view(batch, seq_len, kv_num_heads, head_size).transpose(1, 2)
    v = value.view(batch, seq_len, kv_num_heads, head_size).transpose(1, 2)

    # past_seqlen = seqlens_k + 1 - sequence_length; new tokens sit after it
    past_seqlen = (seqlens_k.long() + 1 - seq_len)
    position_ids = past_seqlen[:, None] + torch.arange(seq_len, device=q.device)[None, :]
    if do_rotary:
        q = rotary_embedding(q, position_ids, cos_cache, sin_cache, rotary_interleaved)
        k = rotary_embedding(k, position_ids, cos_cache, sin_cache, rotary_interleaved)

    alpha = scale if scale != 0.0 else 1.0 / math.sqrt(head_size)
    kv_num_heads_factor = num_heads // kv_num_heads
    kv_index = torch.arange(num_heads, device=q.device) // kv_num_heads_factor
    k_for_head = k[:, kv_index]
    v_for_head = v[:, kv_index]

    probs = torch.matmul(q, k_for_head.transpose(-1, -2)) * alpha  # (B, N, S, T)
    total = total_sequence_length
    key_pos = torch.arange(total, device=q.device)
    seq_causal_length = position_ids[:, None, :, None] + 1  # keys 0..pos are visible
    hidden = key_pos[None, None, None, :] >= seq_causal_length
    if local_window_size >= 0:
        hidden = hidden | (key_pos[None, None, None, :] < seq_causal_length - local_window_size - 1)
    probs = probs.masked_fill(hidden, -10000.0)
    probs = probs - probs.amax(dim=-1, keepdim=True)
    probs = probs.exp()
    probs = probs / probs.sum(dim=-1, keepdim=True)

    output = torch.matmul(probs, v_for_head)  # (B, N, S, H)
    return output.transpose(1, 2).reshape(batch, seq_len, num_heads * head_size)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class GQAAttention(nn.Module):
    """The module an exporter lowers to one GroupQueryAttention node."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.kv_num_heads = config.num_key_value_heads
        self.head_size = config.hidden_size // self.num_heads
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.kv_num_heads) * self.head_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_size, config.hidden_size, bias=False)
        self.rotary_interleaved = int(config.rotary_interleaved)
        self.local_window_size = config.sliding_window - 1 if config.sliding_window else -1
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.rotary_dim, 2, dtype=torch.float64) / config.rotary_dim))
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, hidden_states):
        batch, seq_len, _ = hidden_states.shape
        seqlens_k = torch.full((batch,), seq_len - 1, dtype=torch.int32, device=hidden_states.device)
        attn = group_query_attention(
            self.qkv_proj(hidden_states), None, None, seqlens_k, seq_len,
            self.cos_cache.to(hidden_states.dtype), self.sin_cache.to(hidden_states.dtype),
            num_heads=self.num_heads, kv_num_heads=self.kv_num_heads, scale=0.0,
            local_window_size=self.local_window_size, do_rotary=1,
            rotary_interleaved=self.rotary_interleaved,
        )
        return self.o_proj(attn)


class ExportedDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = GQAAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 256, bias=False)
        self.down_proj = nn.Linear(128, config.hidden_size, bias=False)

    def forward(self, x):
        x = x + self.attn(self.input_layernorm(x))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate) * up)


class ExportedDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([ExportedDecoderLayer(config)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def make_ort_gqa_decoder():
    torch.manual_seed(2423)
    model = ExportedDecoder(ExportConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_ort_gqa_decoder',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.attn',
 'stage': 'keys',
 'mistake': 'wrong_projection',
 'style': 'ONNX Runtime GQA port: key = packed[..., :kv_size] (query columns)'}
