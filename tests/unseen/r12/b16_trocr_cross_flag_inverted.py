"""Hugging Face TrOCR decoder cross-attention: TrOCRAttention(is_cross_attention=True) with
kdim = vdim = cross_attention_hidden_size (the 48-wide encoder output), q_proj(hidden) * scaling
before the (bsz * heads, len, head_dim) fold, bmm, softmax, bmm, view/transpose/reshape back,
out_proj. Post-norm: residual + encoder_attn, then encoder_attn_layer_norm. Target called as
(hidden_states, encoder_hidden_states).

This file's one bug: TrOCR encoder_attn: is_cross_attention = key_value_states is None, so keys and
values are projected from the decoder hidden states."""

import math

import torch
from torch import nn


class TrOCRAttention(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        kdim=None,
        vdim=None,
        dropout=0.0,
        is_decoder=False,
        bias=True,
        is_cross_attention=False,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        if not (self.head_dim * num_heads == self.embed_dim):
            raise ValueError("embed_dim must be divisible by num_heads")
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is None
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))

        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)

        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, None


class TrOCRCrossBlock(nn.Module):
    def __init__(self, d_model=64, heads=4, cross_attention_hidden_size=48):
        super().__init__()
        self.encoder_attn = TrOCRAttention(
            d_model,
            heads,
            kdim=cross_attention_hidden_size,
            vdim=cross_attention_hidden_size,
            is_decoder=True,
            is_cross_attention=True,
        )
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden_states, encoder_hidden_states):
        residual = hidden_states
        hidden_states, _ = self.encoder_attn(
            hidden_states=hidden_states, key_value_states=encoder_hidden_states
        )
        hidden_states = residual + hidden_states
        return self.encoder_attn_layer_norm(hidden_states)


def make_trocr_cross():
    torch.manual_seed(1205)
    block = TrOCRCrossBlock(cross_attention_hidden_size=None)
    with torch.no_grad():
        block.encoder_attn_layer_norm.weight.uniform_(0.5, 1.5)
        block.encoder_attn_layer_norm.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_trocr_cross",
    "kind": "cross",
    "ok": False,
    "layer": "encoder_attn",
    "stage": "keys",
    "mistake": "wrong_source",
    "style": "TrOCR encoder_attn: is_cross_attention = key_value_states is None, so keys and values "
    "are projected from the decoder hidden states",
}
