"""diffusers Cosmos (`CosmosTransformerBlock` cross-attention `attn2`, run by `CosmosAttnProcessor2_0`):
`to_q` on the video tokens, `to_k`/`to_v` on the text embedding (`cross_attention_dim` may differ from
the hidden size), `unflatten(2, (heads, -1)).transpose(1, 2)`, per-head RMSNorm `norm_q`/`norm_k`
(qk_norm="rms_norm", elementwise_affine), `F.scaled_dot_product_attention(..., is_causal=False)`,
`transpose(1, 2).flatten(2, 3)`, `to_out` = [Linear, Dropout]. The target is the block's cross step:
`norm2` (LayerNorm standing in for the AdaLN-single modulation, no timestep), `attn2`, residual.

This file: one bug: the block calls attn2 without encoder_hidden_states, so the processor falls back to the video tokens."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            hidden_states = hidden_states * self.weight
        return hidden_states


class CosmosAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class Attention(nn.Module):
    """The slice of diffusers' Attention that Cosmos uses."""

    def __init__(self, query_dim, cross_attention_dim=None, heads=8, dim_head=64, qk_norm="rms_norm",
                 elementwise_affine=True, out_bias=False, processor=None):
        super().__init__()
        self.heads = heads
        inner_dim = dim_head * heads
        cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(cross_attention_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(cross_attention_dim, inner_dim, bias=False)
        if qk_norm == "rms_norm":
            self.norm_q = RMSNorm(dim_head, eps=1e-6, elementwise_affine=elementwise_affine)
            self.norm_k = RMSNorm(dim_head, eps=1e-6, elementwise_affine=elementwise_affine)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim, bias=out_bias), nn.Dropout(0.0)])
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


class CosmosCrossStep(nn.Module):
    """The cross-attention part of CosmosTransformerBlock.forward."""

    def __init__(self, hidden_size, num_attention_heads, attention_head_dim, cross_attention_dim):
        super().__init__()
        self.norm2 = nn.LayerNorm(hidden_size, eps=1e-6, elementwise_affine=True)
        self.attn2 = Attention(
            query_dim=hidden_size,
            cross_attention_dim=cross_attention_dim,
            heads=num_attention_heads,
            dim_head=attention_head_dim,
            qk_norm="rms_norm",
            elementwise_affine=True,
            out_bias=False,
            processor=CosmosAttnProcessor2_0(),
        )

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        norm_hidden_states = self.norm2(hidden_states)
        attn_output = self.attn2(norm_hidden_states,
                                 attention_mask=attention_mask)
        return hidden_states + attn_output


def make_cosmos_cross():
    torch.manual_seed(2643)
    block = CosmosCrossStep(64, 8, 8, 64)
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {'target': 'make_cosmos_cross',
 'kind': 'cross',
 'ok': False,
 'layer': 'attn2',
 'stage': 'keys',
 'mistake': 'wrong_source',
 'style': 'Cosmos block: attn2(norm_hidden_states) - encoder_hidden_states not passed'}
