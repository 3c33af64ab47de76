"""Falcon-7B attention as in the Hugging Face port of 2023: multi_query=True, so query_key_value yields
num_heads query heads plus one shared key and one shared value head; the rotary (rotate_half) belongs to
the attention; keys/values are broadcast to every head and SDPA runs with is_causal=True."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class FalconRotaryEmbedding(nn.Module):
    """Rotary positional embeddings with a cache rebuilt whenever the sequence length changes."""

    def __init__(self, head_dim: int, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head_dim = head_dim
        self.seq_len_cached = -1
        self.cos_cached = None
        self.sin_cached = None

    def cos_sin(self, seq_len, past_key_values_length, device, dtype):
        total_length = seq_len + past_key_values_length
        if total_length > self.seq_len_cached or self.cos_cached.dtype != dtype:
            self.seq_len_cached = total_length
            t = torch.arange(total_length, device=device, dtype=self.inv_freq.dtype)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(device)
            self.cos_cached = emb.cos()[None, :, :].to(dtype)
            self.sin_cached = emb.sin()[None, :, :].to(dtype)
        return (
            self.cos_cached[:, past_key_values_length : seq_len + past_key_values_length],
            self.sin_cached[:, past_key_values_length : seq_len + past_key_values_length],
        )

    def forward(self, query, key, past_key_values_length=0):
        batch, seq_len, head_dim = query.shape
        cos, sin = self.cos_sin(seq_len, past_key_values_length, query.device, query.dtype)
        return (query * cos) + (rotate_half(query) * sin), (key * cos) + (rotate_half(key) * sin)


class FalconAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.split_size = self.hidden_size
        self.hidden_dropout = config.hidden_dropout
        self.is_causal = True

        self.maybe_rotary = (
            FalconRotaryEmbedding(self.head_dim, base=config.rope_theta)
            if config.rotary
            else lambda q, k, t: (q, k)
        )

        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = self.inv_norm_factor
        if config.new_decoder_architecture:
            qkv_out_dim = (config.num_kv_heads * 2 + config.num_attention_heads) * self.head_dim
        elif config.multi_query:
            qkv_out_dim = self.hidden_size + 2 * self.head_dim
        else:
            qkv_out_dim = 3 * self.hidden_size
        self.query_key_value = nn.Linear(self.hidden_size, qkv_out_dim, bias=config.bias)
        self.new_decoder_architecture = config.new_decoder_architecture
        self.multi_query = config.multi_query
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=config.bias)
        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.num_kv_heads = (
            config.num_kv_heads if (self.new_decoder_architecture or not self.multi_query) else 1
        )

    def _split_heads(self, fused_qkv):
        """Split the last dimension into (num_heads, head_dim) for queries and (1, head_dim) for the shared
        key and value of multi-query attention."""
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
        return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]

    def _merge_heads(self, x):
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, attention_mask=None, layer_past=None):
        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]
        num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        # 3 x [batch_size, seq_length, num_heads, head_dim]
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)

        batch_size, query_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, query_length, self.head_dim
        )
        key_layer = key_layer.transpose(1, 2).reshape(
            batch_size * num_kv_heads, query_length, self.head_dim
        )
        value_layer = value_layer.transpose(1, 2).reshape(
            batch_size * num_kv_heads, query_length, self.head_dim
        )

        past_kv_length = 0 if layer_past is None else layer_past[0].shape[1]
        query_layer, key_layer = self.maybe_rotary(query_layer, key_layer, past_kv_length)

        query_layer_ = query_layer.reshape(batch_size, self.num_heads, -1, self.head_dim)
        key_layer_ = key_layer.reshape(batch_size, num_kv_heads, -1, self.head_dim)
        value_layer_ = value_layer.reshape(batch_size, num_kv_heads, -1, self.head_dim)

        # multi-query: the single key/value head is broadcast to every query head
        key_layer_ = key_layer_.expand(-1, self.num_heads, -1, -1)
        value_layer_ = value_layer_.expand(-1, self.num_heads, -1, -1)

        attn_output = F.scaled_dot_product_attention(
            query_layer_, key_layer_, value_layer_, attn_mask=None, dropout_p=0.0, is_causal=True
        )
        x = attn_output.view(batch_size, self.num_heads, query_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        attn_output = x.reshape(batch_size, query_length, self.num_heads * self.head_dim)
        output_tensor = self.dense(attn_output)
        return output_tensor, None


def make_attention():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=None,
        multi_query=True,
        new_decoder_architecture=False,
        rotary=True,
        rope_theta=10000.0,
        bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        alibi=False,
    )
    return FalconAttention(config)


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "ok": True,
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Falcon-7B FalconAttention, HF 2023 port (multi_query fused query_key_value -> num_heads + 2 slices, maybe_rotary on (b*h, t, d), expand + SDPA is_causal)",
}
