"""ByteDance Bagel (modeling/bagel/qwen2_navit.py): Qwen2 language model run NaViT-style on a packed
(tokens, hidden) sequence with per-sample lengths and cu_seqlens; PackedAttention with q/k/v bias,
per-head q_norm/k_norm (config.qk_norm), rotate_half rotary on (tokens, heads, head_dim), kv heads
repeated per group ([:, :, None, :].repeat), flash_attn_varlen_func (CPU stand-in with flash-attn
semantics, window_size=(left, right)), o_proj.

This file: correct (packed varlen causal attention, GQA 4:2, per-head q_norm/k_norm, rope_theta 1e6)."""

from typing import List, Optional

import torch
from torch import nn


class Qwen2Config:
    """The fields of Bagel's Qwen2Config that the language model reads."""

    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    rope_theta = 1000000.0
    use_sliding_window = False
    sliding_window = None
    max_window_layers = 0
    qk_norm = True
    is_causal = True


class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Qwen2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, None].to(torch.float64) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1)):
    """CPU stand-in for flash_attn.flash_attn_varlen_func with its semantics: packed (total, heads,
    head_dim) tensors, one attention per cu_seqlens segment, causal aligned bottom-right, and
    window_size=(left, right): key j visible from query i when i - left <= j <= i + right."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    n_seq = cu_seqlens_q.shape[0] - 1
    for b in range(n_seq):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qb = q[qs:qe].transpose(0, 1)
        kb = k[ks:ke].transpose(0, 1)
        vb = v[ks:ke].transpose(0, 1)
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * softmax_scale
        lq, lk = qe - qs, ke - ks
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=q.device)[None, :]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        left, right = window_size
        if causal:
            right = 0
        if left >= 0:
            keep = keep & (j >= i - left)
        if right >= 0:
            keep = keep & (j <= i + right)
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qs:qe] = torch.matmul(probs, vb).transpose(0, 1)
    return out


class Qwen2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class PackedAttention(nn.Module):
    """Bagel's PackedAttention (qwen2_navit.py): Qwen2 projections (q/k/v with bias), per-head
    q_norm/k_norm when config.qk_norm, rotary on the packed (tokens, heads, head_dim) states, kv heads
    repeated per group, flash_attn_varlen_func over the cu_seqlens segments, o_proj."""

    def __init__(self, config, layer_idx: Optional[int] = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = config.is_causal
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = nn.Identity()
            self.k_norm = nn.Identity()
        self.sliding_window = None
        if (
            config.use_sliding_window
            and config.sliding_window is not None
            and layer_idx >= config.max_window_layers
        ):
            self.sliding_window = config.sliding_window

    def forward(self, packed_query_sequence, query_lens, packed_query_position_embeddings, cu_seqlens):
        packed_query_states = self.q_proj(packed_query_sequence).view(-1, self.num_heads, self.head_dim)
        packed_key_states = self.k_proj(packed_query_sequence).view(-1, self.num_key_value_heads, self.head_dim)
        packed_value_states = self.v_proj(packed_query_sequence).view(-1, self.num_key_value_heads, self.head_dim)

        packed_query_states = self.q_norm(packed_query_states)
        packed_key_states = self.k_norm(packed_key_states)

        packed_cos, packed_sin = packed_query_position_embeddings
        packed_query_states, packed_key_states = apply_rotary_pos_emb(
            packed_query_states, packed_key_states, packed_cos, packed_sin, unsqueeze_dim=1
        )

        packed_key_states = packed_key_states[:, :, None, :].repeat(1, 1, self.num_key_value_groups, 1)
        packed_key_states = packed_key_states.reshape(-1, self.num_heads, self.head_dim)
        packed_value_states = packed_value_states[:, :, None, :].repeat(1, 1, self.num_key_value_groups, 1)
        packed_value_states = packed_value_states.reshape(-1, self.num_heads, self.head_dim)

        if self.sliding_window is not None:
            window_size = (self.sliding_window - 1, self.sliding_window - 1)
        else:
            window_size = (-1, -1)
        max_len = int(query_lens.max())
        packed_attn_output = flash_attn_varlen_func(
            q=packed_query_states,
            k=packed_key_states,
            v=packed_value_states,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_len,
            max_seqlen_k=max_len,
            causal=self.is_causal,
            window_size=window_size,
        )
        packed_attn_output = packed_attn_output.reshape(-1, self.hidden_size)
        return self.o_proj(packed_attn_output)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = PackedAttention(config, layer_idx)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, packed_query_sequence, query_lens, packed_query_position_embeddings, cu_seqlens):
        residual = packed_query_sequence
        hidden = self.input_layernorm(packed_query_sequence)
        hidden = self.self_attn(hidden, query_lens, packed_query_position_embeddings, cu_seqlens)
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden


class Qwen2Model(nn.Module):
    """Bagel's Qwen2Model (navit): the batch is packed into one (tokens, hidden) sequence with
    per-sample lengths; position ids restart at 0 for every sample."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([Qwen2DecoderLayer(config, 0)])
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config)

    def forward(self, inputs_embeds):
        B, T, D = inputs_embeds.shape
        packed_query_sequence = inputs_embeds.reshape(B * T, D)
        query_lens = torch.full((B,), T, dtype=torch.int32, device=inputs_embeds.device)
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(query_lens, dim=0, dtype=torch.int32), (1, 0))
        packed_position_ids = torch.cat([torch.arange(int(l), device=inputs_embeds.device) for l in query_lens])
        cos, sin = self.rotary_emb(packed_query_sequence, packed_position_ids)
        hidden = packed_query_sequence
        for layer in self.layers:
            hidden = layer(hidden, query_lens, (cos, sin), cu_seqlens)
        hidden = self.norm(hidden)
        return hidden.reshape(B, T, D)


def _init(model):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Qwen2RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


def make_bagel_language_model():
    torch.manual_seed(3106)
    config = Qwen2Config()
    return _init(Qwen2Model(config))



EXPECT = {'target': 'make_bagel_language_model',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.self_attn',
 'structure': {'heads': 4,
               'kv_heads': 2,
               'head_dim': 16,
               'causal': True,
               'cross': False,
               'rope': {'pairing': 'half', 'fraction': 1.0, 'base': 1000000},
               'qk_norm': 'per-head',
               'window': None,
               'bias': None},
 'style': 'Bagel PackedAttention (ByteDance-Seed/Bagel modeling/bagel/qwen2_navit.py): correct '
          '(packed varlen causal attention, GQA 4:2, per-head q_norm/k_norm, rope_theta 1e6)'}
