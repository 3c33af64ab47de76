"""Hugging Face-style encoder-decoder decoder layer where one attention class serves both roles through an
is_cross_attention flag (GQA 4 query heads over 2 key/value heads, repeat_kv, SDPA); bug: the decoder
layer builds its cross_attn without is_cross_attention=True, so the layer receives the encoder states
but projects keys and values from the decoder's own hidden states."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class DecoderAttention(nn.Module):
    def __init__(self, config, layer_idx=None, is_causal=True, is_cross_attention=False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.is_causal = is_causal
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.cross_attention_hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.cross_attention_hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        current_states = encoder_hidden_states if self.is_cross_attention else hidden_states
        kv_len = current_states.shape[1]

        query_states = (
            self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )
        key_states = (
            self.k_proj(current_states).view(bsz, kv_len, -1, self.head_dim).transpose(1, 2)
        )
        value_states = (
            self.v_proj(current_states).view(bsz, kv_len, -1, self.head_dim).transpose(1, 2)
        )

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=attention_mask,
            scale=self.scaling,
            is_causal=self.is_causal and attention_mask is None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), None


class CrossAttentionBlock(nn.Module):
    """Pre-norm cross-attention sub-block of the decoder (self-attention and MLP live in sibling blocks)."""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.pre_cross_attn_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.cross_attn = DecoderAttention(config, layer_idx, is_causal=False)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        residual = hidden_states
        hidden_states = self.pre_cross_attn_layernorm(hidden_states)
        hidden_states, _ = self.cross_attn(
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
        )
        return residual + hidden_states


def make_cross_block():
    config = SimpleNamespace(
        hidden_size=64,
        cross_attention_hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
    )
    return CrossAttentionBlock(config)


EXPECT = {
    "target": "make_cross_block",
    "kind": "cross",
    "ok": False,
    "stage": "keys",
    "mistake": "wrong_source",
    "layer": "cross_attn",
    "style": "Hugging Face-style shared DecoderAttention with an is_cross_attention flag (GQA 4:2 repeat_kv, SDPA); cross_attn constructed without the flag, so k/v come from the decoder states",
}
