"""A torch port of PaddleNLP's Llama (`paddlenlp/transformers/llama/modeling.py`), kept close to
Paddle's conventions: Paddle `nn.Linear` stores its weight as (in_features, out_features) and
computes `x @ W + b`; activations stay [bs, seq, heads, head_dim]; `fuse_attention_qkv=True` gives one
`qkv_proj` whose output is reshaped to `[0, 0, num_heads, 3 * head_dim]` and split into q|k|v per head;
`LlamaRotaryEmbedding` caches cos/sin of width head_dim (`concat([freqs, freqs])`) and
`apply_rotary_pos_emb` gathers them by `position_ids`; the model builds `position_ids` and the
additive mask (`_prepare_decoder_attention_mask` then `where(mask, 0.0, finfo.min)`); the free
function `scaled_dot_product_attention` does `matmul(q / sqrt(d), k, transpose_y=True)`. Norms and
MLPs of the decoder layer are left out.

This file: one bug: `F.softmax(attn_weights, axis=-2)` normalises over the queries instead of the keys"""

import math
import torch
import torch.nn.functional as F
from torch import nn


class LlamaConfig:
    hidden_size = 64
    num_attention_heads = 4
    max_position_embeddings = 128
    rope_theta = 10000.0
    fuse_attention_qkv = True


class PaddleLinear(nn.Module):
    def __init__(self, in_features, out_features, bias_attr=False):
        super().__init__()
        bound = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_features).uniform_(-bound, bound)) if bias_attr else None

    def forward(self, x):
        y = torch.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    # cos/sin [seq, dim] -> [bs, seq, 1, dim]
    cos = cos[position_ids].unsqueeze(2)
    sin = sin[position_ids].unsqueeze(2)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def scaled_dot_product_attention(query_states, key_states, value_states, attention_mask):
    bsz, q_len, num_heads, head_dim = query_states.shape
    _, kv_seq_len, _, _ = value_states.shape
    query_states = query_states.permute(0, 2, 1, 3)
    key_states = key_states.permute(0, 2, 1, 3)
    value_states = value_states.permute(0, 2, 1, 3)
    attn_weights = torch.matmul(query_states / math.sqrt(head_dim), key_states.transpose(-1, -2))
    attention_mask = attention_mask.reshape(bsz, 1, q_len, kv_seq_len)
    attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-2)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.permute(0, 2, 1, 3)
    return attn_output.reshape(bsz, q_len, head_dim * num_heads)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.qkv_proj = PaddleLinear(self.hidden_size, 3 * self.hidden_size, bias_attr=False)
        self.o_proj = PaddleLinear(self.hidden_size, self.hidden_size, bias_attr=False)
        self.rotary_emb = LlamaRotaryEmbedding(
            self.head_dim, config.max_position_embeddings, config.rope_theta
        )

    def forward(self, hidden_states, position_ids, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        mix_layer = self.qkv_proj(hidden_states)
        mix_layer = mix_layer.reshape(bsz, q_len, self.num_heads, 3 * self.head_dim)
        query_states, key_states, value_states = torch.split(mix_layer, self.head_dim, dim=-1)
        kv_seq_len = key_states.shape[-3]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        attn_output = scaled_dot_product_attention(query_states, key_states, value_states, attention_mask)
        attn_output = self.o_proj(attn_output)
        return attn_output


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)

    def forward(self, hidden_states, position_ids, attention_mask):
        return hidden_states + self.self_attn(hidden_states, position_ids, attention_mask)


def _make_causal_mask(input_ids_shape):
    batch_size, target_length = input_ids_shape
    mask = torch.tril(torch.ones((target_length, target_length), dtype=torch.bool))
    return mask[None, None, :, :].expand(batch_size, 1, target_length, target_length)


def _expand_2d_mask(mask, tgt_length):
    batch_size, src_length = mask.shape
    return mask[:, None, None, :].bool().expand(batch_size, 1, tgt_length, src_length)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config)])

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, dtype):
        expanded_attn_mask = _expand_2d_mask(attention_mask, tgt_length=input_shape[-1])
        combined = expanded_attn_mask & _make_causal_mask(input_shape)
        return torch.where(combined, torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))

    def forward(self, inputs_embeds):
        batch_size, seq_length, _ = inputs_embeds.shape
        attention_mask = torch.ones((batch_size, seq_length), dtype=torch.bool)
        position_ids = torch.arange(seq_length, dtype=torch.int64)[None, :].expand(batch_size, seq_length)
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds.dtype
        )
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_ids, attention_mask)
        return hidden_states


def make_paddle_llama():
    torch.manual_seed(1766)
    return LlamaModel(LlamaConfig()).eval()


EXPECT = {'target': 'make_paddle_llama',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'weights',
 'mistake': 'softmax_wrong_dim',
 'style': 'PaddleNLP port: one bug: `F.softmax(attn_weights, axis=-2)` normalises over the queries '
          'instead of the keys'}
