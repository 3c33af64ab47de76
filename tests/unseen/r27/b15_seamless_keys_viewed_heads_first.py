"""Hugging Face SeamlessM4T v2 text decoder, cross-attention step (SeamlessM4Tv2Attention with
encoder_hidden_states): q_proj/k_proj/v_proj/out_proj with bias, queries multiplied by
self.scaling = head_dim**-0.5 right after the projection, _shape() = view(..., heads, head_dim)
.permute(0, 2, 1, 3), keys and values projected from the encoder states (the cached-cross-attention
branch of the original is reduced to the prefill case), matmul scores, softmax, matmul, out_proj.
Target is the decoder layer's cross-attention sub-block: cross_attention_layer_norm, the attention
and the residual add.

This file: one bug: keys viewed as (batch, heads, -1, head_dim) straight from (batch, tokens, hidden), mixing tokens and features"""

import torch
from torch import nn


class SeamlessM4Tv2Config:
    hidden_size = 64
    decoder_attention_heads = 8
    attention_dropout = 0.0
    layer_norm_eps = 1e-5


class SeamlessM4Tv2Attention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, is_decoder=False, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        if (self.head_dim * num_heads) != self.embed_dim:
            raise ValueError("embed_dim must be divisible by num_heads")
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, projection):
        new_projection_shape = projection.size()[:-1] + (self.num_heads, self.head_dim)
        # move heads to 2nd position (B, T, H * D) -> (B, T, H, D) -> (B, H, T, D)
        return projection.view(new_projection_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, encoder_hidden_states=None, past_key_value=None, attention_mask=None):
        is_cross_attention = encoder_hidden_states is not None
        batch_size, seq_length = hidden_states.shape[:2]

        # use encoder_hidden_states if cross attention
        current_states = encoder_hidden_states if encoder_hidden_states is not None else hidden_states
        if is_cross_attention and past_key_value is not None:
            key_states, value_states = past_key_value
        else:
            key_states = self.k_proj(current_states).view(batch_size, self.num_heads, -1, self.head_dim)
            value_states = self._shape(self.v_proj(current_states))

        query_states = self.q_proj(hidden_states) * self.scaling
        query_states = self._shape(query_states)

        attention_scores = torch.matmul(query_states, key_states.transpose(-1, -2))
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask

        attn_weights = nn.functional.softmax(attention_scores, dim=-1)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)

        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, seq_length, self.embed_dim)
        return self.out_proj(attn_output)


class SeamlessM4Tv2CrossAttentionBlock(nn.Module):
    """The cross-attention part of SeamlessM4Tv2DecoderLayer."""

    def __init__(self, config):
        super().__init__()
        self.cross_attention = SeamlessM4Tv2Attention(
            config.hidden_size,
            config.decoder_attention_heads,
            config.attention_dropout,
            is_decoder=True,
        )
        self.cross_attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, encoder_hidden_states):
        residual = hidden_states
        hidden_states = self.cross_attention_layer_norm(hidden_states)
        hidden_states = self.cross_attention(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
        )
        return residual + hidden_states


def make_seamless_cross():
    torch.manual_seed(2735)
    config = SeamlessM4Tv2Config()
    block = SeamlessM4Tv2CrossAttentionBlock(config)
    with torch.no_grad():
        block.cross_attention_layer_norm.weight.uniform_(0.5, 1.5)
        block.cross_attention_layer_norm.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_seamless_cross",
    "kind": "cross",
    "ok": False,
    "layer": "cross_attention",
    "stage": "keys",
    "mistake": "heads_split",
    "style": "SeamlessM4T v2 SeamlessM4Tv2Attention cross: keys .view(b, heads, -1, head_dim) without the permute",
}
