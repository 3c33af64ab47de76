"""A torch port of Hugging Face candle's Rust transformer code (candle-transformers `models/llama.rs`,
`mistral.rs`, `chatglm.rs`, `mpt.rs`), kept close to its structure: a shared `RotaryEmbedding` held
by every layer (an `Arc` in Rust) with `sin`/`cos` tables of half width, narrowed by `seqlen_offset`;
candle_nn's `rotary_emb::rope` (halves) and `rope_i` (interleaved pairs) on contiguous (b, h, t, d)
tensors, with partial rotary split by `narrow`; `repeat_kv` as candle writes it (`cat` of n_rep copies
along the sequence axis, then `reshape`); an additive mask built by the model from a flat Vec of
0 / -inf (`prepare_decoder_attention_mask`), `broadcast_add`, `softmax_last_dim`. The MPT variant
builds its ALiBi bias as candle's `build_alibi_bias` does (`arange(1 - seq_len, 1)` times
`1 / 2^(k * alibi_bias_max / n_heads)`). Norms and MLPs of the decoder layer are left out.

This file: correct (llama.rs: GQA 4:2, rope halves, base 10000, causal)"""

import math
import torch
from torch import nn


class Config:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    max_position_embeddings = 64
    rope_theta = 10000.0
    partial_rotary_factor = 1.0
    rope_interleaved = False
    use_rope = True
    sliding_window = None
    alibi = False
    alibi_bias_max = 8.0


def rope(xs, cos, sin):
    """candle_nn::rotary_emb::rope: the two halves of the last axis form the pairs."""
    half = xs.shape[-1] // 2
    cos = torch.cat([cos, cos], dim=-1)
    sin = torch.cat([sin, sin], dim=-1)
    rotated = torch.cat([-xs[..., half:], xs[..., :half]], dim=-1)
    return xs * cos + rotated * sin


def rope_i(xs, cos, sin):
    """candle_nn::rotary_emb::rope_i: consecutive elements (2i, 2i + 1) form the pairs."""
    x_even = xs[..., 0::2]
    x_odd = xs[..., 1::2]
    out_even = x_even * cos - x_odd * sin
    out_odd = x_even * sin + x_odd * cos
    return torch.stack([out_even, out_odd], dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.rot_dim = int(head_dim * cfg.partial_rotary_factor)
        self.interleaved = cfg.rope_interleaved
        inv_freq = [
            1.0 / cfg.rope_theta ** (i / self.rot_dim) for i in range(0, self.rot_dim, 2)
        ]
        inv_freq = torch.tensor(inv_freq, dtype=torch.float64)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
        freqs = t[:, None] * inv_freq[None, :]
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.register_buffer("cos", freqs.cos(), persistent=False)

    def apply_rotary_emb_qkv(self, q, k, seqlen_offset):
        _b, _h, seq_len, head_dim = q.shape
        cos = self.cos.narrow(0, seqlen_offset, seq_len).to(q.dtype)
        sin = self.sin.narrow(0, seqlen_offset, seq_len).to(q.dtype)
        rope_fn = rope_i if self.interleaved else rope
        if self.rot_dim == head_dim:
            return rope_fn(q.contiguous(), cos, sin), rope_fn(k.contiguous(), cos, sin)
        q_rot, q_pass = q.narrow(-1, 0, self.rot_dim), q.narrow(-1, self.rot_dim, head_dim - self.rot_dim)
        k_rot, k_pass = k.narrow(-1, 0, self.rot_dim), k.narrow(-1, self.rot_dim, head_dim - self.rot_dim)
        q = torch.cat([rope_fn(q_rot.contiguous(), cos, sin), q_pass], dim=-1)
        k = torch.cat([rope_fn(k_rot.contiguous(), cos, sin), k_pass], dim=-1)
        return q, k


def repeat_kv(xs, n_rep):
    if n_rep == 1:
        return xs
    b_sz, n_kv_head, seq_len, head_dim = xs.shape
    return torch.cat([xs] * n_rep, dim=2).reshape(b_sz, n_kv_head * n_rep, seq_len, head_dim)


def build_alibi_bias(cfg):
    n_heads = cfg.num_attention_heads
    full_len = cfg.max_position_embeddings
    alibi_bias = torch.arange(1 - full_len, 1, dtype=torch.float64).reshape(1, 1, 1, full_len)
    n_heads_p2 = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, n_heads_p2 + 1, dtype=torch.float64) * (cfg.alibi_bias_max / n_heads_p2)
    slopes = 1.0 / torch.pow(2.0, m)
    if n_heads_p2 != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return alibi_bias * slopes.reshape(1, n_heads, 1, 1)


class Attention(nn.Module):
    def __init__(self, rotary_emb, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.hidden_size = cfg.hidden_size
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary_emb = rotary_emb if cfg.use_rope else None
        if cfg.alibi:
            self.register_buffer("alibi", build_alibi_bias(cfg), persistent=False)
        else:
            self.alibi = None

    def forward(self, xs, attention_mask, seqlen_offset):
        b_sz, q_len, _ = xs.shape
        query_states = self.q_proj(xs)
        key_states = self.k_proj(xs)
        value_states = self.v_proj(xs)
        query_states = query_states.reshape(b_sz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.reshape(b_sz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.reshape(b_sz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary_emb is not None:
            query_states, key_states = self.rotary_emb.apply_rotary_emb_qkv(
                query_states, key_states, seqlen_offset
            )
        key_states = repeat_kv(key_states, self.num_kv_groups).contiguous()
        value_states = repeat_kv(value_states, self.num_kv_groups).contiguous()
        scale = 1.0 / math.sqrt(self.head_dim)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * scale
        if self.alibi is not None:
            kv_len = key_states.shape[2]
            attn_weights = attn_weights + self.alibi[..., -kv_len:].to(attn_weights.dtype)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = torch.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(b_sz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class DecoderLayer(nn.Module):
    def __init__(self, rotary_emb, cfg):
        super().__init__()
        self.self_attn = Attention(rotary_emb, cfg)

    def forward(self, xs, attention_mask, seqlen_offset):
        return xs + self.self_attn(xs, attention_mask, seqlen_offset)


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList([DecoderLayer(self.rotary_emb, cfg)])
        self.sliding_window = cfg.sliding_window

    def prepare_decoder_attention_mask(self, b_size, tgt_len, seqlen_offset, dtype):
        sliding_window = self.sliding_window if self.sliding_window is not None else tgt_len + 1
        mask = [
            float("-inf") if (i < j or j + sliding_window <= i) else 0.0
            for i in range(tgt_len)
            for j in range(tgt_len)
        ]
        mask = torch.tensor(mask, dtype=dtype).reshape(tgt_len, tgt_len)
        return mask.expand(b_size, 1, tgt_len, tgt_len)

    def forward(self, xs, seqlen_offset=0):
        b_size, seq_len, _ = xs.shape
        attention_mask = None
        if seq_len > 1:
            attention_mask = self.prepare_decoder_attention_mask(b_size, seq_len, seqlen_offset, xs.dtype)
        for layer in self.layers:
            xs = layer(xs, attention_mask, seqlen_offset)
        return xs


def make_candle_llama():
    torch.manual_seed(1731)
    return Model(Config()).eval()


EXPECT = {'target': 'make_candle_llama',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.self_attn',
 'structure': {'heads': 4,
               'kv_heads': 2,
               'head_dim': 16,
               'causal': True,
               'cross': False,
               'rope': {'pairing': 'half', 'fraction': 1.0, 'base': 10000},
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'candle-transformers port: correct (llama.rs: GQA 4:2, rope halves, base 10000, causal)'}
