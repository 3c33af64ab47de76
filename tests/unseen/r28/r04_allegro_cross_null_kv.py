"""rhymes-ai Allegro text-to-video transformer, the cross-attention half of its `BasicTransformerBlock`
(allegro/models/transformers/block.py, a diffusers-derived `Attention` with `AttnProcessor2_0`-style
processor): `to_q` on the video tokens, `to_k`/`to_v` on the T5 text states (`encoder_hidden_states`),
`attn.prepare_attention_mask` (no mask here), `view(batch_size, -1, attn.heads, head_dim).transpose(1,
2)`, no rotary embedding on the cross path (`attn.is_cross_attention`), non-causal
`F.scaled_dot_product_attention`, `to_out` (Linear, Dropout), `rescale_output_factor`, residual. The
block pre-normalises the video tokens with `norm2` (affine LayerNorm) before `attn2`.

This file: refused: a learned null text token (null key/value per head, Imagen-style null_kv) prepended to the projected text keys and values, attended by every query."""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, query_dim, cross_attention_dim=None, heads=8, dim_head=64, dropout=0.0, bias=False,
                 out_bias=True, rescale_output_factor=1.0, residual_connection=False, processor=None):
        super().__init__()
        self.inner_dim = dim_head * heads
        self.query_dim = query_dim
        self.is_cross_attention = cross_attention_dim is not None
        self.cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.rescale_output_factor = rescale_output_factor
        self.residual_connection = residual_connection
        self.heads = heads
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, query_dim, bias=out_bias), nn.Dropout(dropout)])
        self.null_kv = nn.Parameter(torch.randn(2, self.inner_dim) * 0.5)
        self.processor = processor if processor is not None else AllegroAttnProcessor2_0()

    def prepare_attention_mask(self, attention_mask, target_length, batch_size):
        if attention_mask is None:
            return attention_mask
        attention_mask = attention_mask.repeat_interleave(self.heads, dim=0)
        return attention_mask

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class AllegroAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        residual = hidden_states
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        null_k, null_v = (t.to(key.dtype)[None, None].expand(key.shape[0], 1, -1) for t in attn.null_kv.unbind(0))
        key = torch.cat([null_k, key], dim=1)
        value = torch.cat([null_v, value], dim=1)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if image_rotary_emb is not None and not attn.is_cross_attention:
            raise NotImplementedError("self-attention path not built in this excerpt")

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        hidden_states = hidden_states / attn.rescale_output_factor
        return hidden_states


class AllegroCrossAttentionBlock(nn.Module):
    """The norm2 -> attn2 -> residual part of Allegro's BasicTransformerBlock."""

    def __init__(self, dim=64, num_attention_heads=8, attention_head_dim=8, cross_attention_dim=64,
                 attention_bias=True):
        super().__init__()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=True)
        self.attn2 = Attention(
            query_dim=dim,
            cross_attention_dim=cross_attention_dim,
            heads=num_attention_heads,
            dim_head=attention_head_dim,
            dropout=0.0,
            bias=attention_bias,
            processor=AllegroAttnProcessor2_0(),
        )

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        norm_hidden_states = self.norm2(hidden_states)
        attn_output = self.attn2(
            norm_hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
        )
        return attn_output + hidden_states


def make_allegro_cross():
    torch.manual_seed(3358)
    block = AllegroCrossAttentionBlock()
    with torch.no_grad():
        block.norm2.weight.uniform_(0.5, 1.5)
        block.norm2.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_allegro_cross",
    "kind": "cross",
    "ok": True,
    "layer": "attn2",
    "unsupported": "null_kv",
    "style": "Allegro attn2 (AllegroAttnProcessor2_0): cross-attention with a learned null key/value token"
}
