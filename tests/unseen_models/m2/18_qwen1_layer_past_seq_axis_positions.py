"""A tiny Qwen (v1, 2023) in the style of Qwen-7B's modeling_qwen.py.

QWenLMHeadModel -> transformer (wte, h ModuleList of QWenBlock(ln_1, attn, ln_2, mlp), ln_f,
rotary_emb) + lm_head.  QWenAttention: fused c_attn (with bias) split into three,
heads split as (b, s, heads, head_dim) and kept in that layout in the cache.  Rotary
(rotate_half pairing) is applied with the last cur_len rows of a table made for kv_seq_len
positions.  Scores divided by sqrt(head_dim) as a torch.full scalar, a tril causal mask sliced
[k - q : k] filled with finfo.min, and c_proj without bias.  QWenMLP: w1 * silu(w2) ->
c_proj.  Legacy tuple cache of (key, value), each (b, seq, heads, head_dim).  12 heads of 8.

Slip: QWenModel computes the past length as past_key_values[0][0].size(-2), the GPT-2 habit.
In this (b, seq, heads, head_dim) layout that is the head count (12), not the cached length.
The rotary table is built for the wrong kv_seq_len, so every decoded token is rotated as
position 12 whatever the real position.  The cache itself grows correctly.  With a prompt
of any length other than 12, the first step is already wrong.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "transformer.h.0.attn"},
    "style": "Qwen-7B modeling_qwen.py: fused c_attn, (b, s, h, d) cache layout, rotary table for kv_seq_len sliced "
    "[-cur_len:]; slip: past length read with size(-2), which is the head axis in this layout",
}


@dataclass
class QWenConfig:
    vocab_size: int = 160
    hidden_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 12
    kv_channels: int = 8
    rotary_pct: float = 1.0
    rotary_emb_base: float = 10000.0
    intermediate_size: int = 256
    layer_norm_epsilon: float = 1e-6
    seq_length: int = 64


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Tuple] = None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float() if x.dtype != torch.float64 else x).type_as(x)
        return output * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._rotary_pos_emb_cache = None

    def update_rotary_pos_emb_cache(self, seqlen):
        if seqlen > self._seq_len_cached or self._rotary_pos_emb_cache is None:
            self._seq_len_cached = max(2 * seqlen, 16)
            seq = torch.arange(self._seq_len_cached, device=self.inv_freq.device).type_as(
                self.inv_freq
            )
            freqs = torch.outer(seq.type_as(self.inv_freq), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            from_shape = emb[None, :, None, :]  # 1, seq, 1, dim
            self._rotary_pos_emb_cache = [from_shape.cos(), from_shape.sin()]

    def forward(self, max_seq_len):
        self.update_rotary_pos_emb_cache(max_seq_len)
        cos, sin = self._rotary_pos_emb_cache
        return [cos[:, :max_seq_len], sin[:, :max_seq_len]]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    cos, sin = freqs
    rot_dim = cos.shape[-1]
    t_, t_pass_ = t[..., :rot_dim], t[..., rot_dim:]
    t_ = (t_ * cos.to(t.dtype)) + (_rotate_half(t_) * sin.to(t.dtype))
    return torch.cat((t_, t_pass_), dim=-1).type_as(t)


class QWenAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)
        self.seq_length = config.seq_length
        self.hidden_size = config.hidden_size
        self.split_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.scale_attn_weights = True
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = self.projection_size // config.num_attention_heads
        self.c_attn = nn.Linear(config.hidden_size, 3 * self.projection_size)
        self.c_proj = nn.Linear(config.hidden_size, self.projection_size, bias=False)

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full(
                [], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device
            )
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = torch.tril(torch.ones((key_length, key_length), dtype=torch.bool)).view(
            1, 1, key_length, key_length
        )
        causal_mask = causal_mask[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        return torch.matmul(attn_weights, value), attn_weights

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(self, hidden_states, rotary_pos_emb, layer_past=None, use_cache=False):
        mixed_x_layer = self.c_attn(hidden_states)
        query, key, value = mixed_x_layer.split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)

        if rotary_pos_emb is not None:
            cur_len = query.shape[1]
            rotary_pos_emb = [i[:, -cur_len:, :, :] for i in rotary_pos_emb]
            query = apply_rotary_pos_emb(query, rotary_pos_emb)
            key = apply_rotary_pos_emb(key, rotary_pos_emb)

        if layer_past is not None:
            past_key, past_value = layer_past[0], layer_past[1]
            key = torch.cat((past_key, key), dim=1)
            value = torch.cat((past_value, value), dim=1)
        present = (key, value) if use_cache else None

        query = query.permute(0, 2, 1, 3)
        key = key.permute(0, 2, 1, 3)
        value = value.permute(0, 2, 1, 3)
        attn_output, attn_weight = self._attn(query, key, value)
        context_layer = self._merge_heads(
            attn_output.transpose(1, 2), self.num_heads, self.head_dim
        )
        attn_output = self.c_proj(context_layer)
        return attn_output, present


class QWenMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        ff_dim_in = config.intermediate_size // 2
        self.w1 = nn.Linear(config.hidden_size, ff_dim_in, bias=False)
        self.w2 = nn.Linear(config.hidden_size, ff_dim_in, bias=False)
        self.c_proj = nn.Linear(ff_dim_in, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        a1 = self.w1(hidden_states)
        a2 = self.w2(hidden_states)
        return self.c_proj(a1 * F.silu(a2))


class QWenBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = QWenAttention(config)
        self.ln_2 = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = QWenMLP(config)

    def forward(self, hidden_states, rotary_pos_emb, layer_past=None, use_cache=False):
        layernorm_output = self.ln_1(hidden_states)
        attn_output, present = self.attn(
            layernorm_output, rotary_pos_emb, layer_past=layer_past, use_cache=use_cache
        )
        layernorm_input = attn_output + hidden_states
        layernorm_output = self.ln_2(layernorm_input)
        return layernorm_input + self.mlp(layernorm_output), present


class QWenModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([QWenBlock(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        dim = int(config.kv_channels * config.rotary_pct)
        self.rotary_emb = RotaryEmbedding(dim, base=config.rotary_emb_base)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)
        hidden_states = self.wte(input_ids)
        kv_seq_len = past_length + hidden_states.size(1)
        rotary_pos_emb = self.rotary_emb(kv_seq_len)
        rotary_pos_emb = [t.to(hidden_states.dtype) for t in rotary_pos_emb]

        presents = () if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(
                hidden_states, rotary_pos_emb, layer_past=layer_past, use_cache=use_cache
            )
            if use_cache:
                presents = presents + (present,)
        return self.ln_f(hidden_states), presents


class QWenLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = QWenModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, presents = self.transformer(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states), past_key_values=presents)


def make_model():
    torch.manual_seed(1818)
    model = QWenLMHeadModel(QWenConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.2 * torch.randn_like(m.bias))
    return model.eval()
