"""diffusers style cross-attention: an `Attention` module holding to_q/to_k/to_v and a
to_out ModuleList (Linear, Dropout), run by an AttnProcessor2_0-like processor;
queries from the 64-wide image tokens, keys/values from 48-wide text encoder states,
inside a BasicTransformerBlock-like block (norm2 -> attn2).
"""

import torch
import torch.nn.functional as F
from torch import nn


class AttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class Attention(nn.Module):
    def __init__(
        self, query_dim, cross_attention_dim=None, heads=8, dim_head=64, bias=False, out_bias=True
    ):
        super().__init__()
        self.inner_dim = dim_head * heads
        cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.heads = heads
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(cross_attention_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(cross_attention_dim, self.inner_dim, bias=bias)
        self.to_out = nn.ModuleList(
            [nn.Linear(self.inner_dim, query_dim, bias=out_bias), nn.Dropout(0.0)]
        )
        self.processor = AttnProcessor2_0()

    def forward(
        self,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        **cross_attention_kwargs,
    ):
        return self.processor(
            self,
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=attention_mask,
        )


class CrossAttnBlock(nn.Module):
    def __init__(self, dim=64, cross_attention_dim=48, heads=4, dim_head=16):
        super().__init__()
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=True)
        self.attn2 = Attention(
            dim, cross_attention_dim=cross_attention_dim, heads=heads, dim_head=dim_head
        )

    def forward(self, hidden_states, encoder_hidden_states):
        norm_hidden_states = self.norm2(hidden_states)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states=encoder_hidden_states)
        return attn_output + hidden_states


def make_cross_block():
    torch.manual_seed(15)
    blk = CrossAttnBlock()
    with torch.no_grad():
        blk.norm2.weight.uniform_(0.5, 1.5)
    return blk


EXPECT = {
    "target": "make_cross_block",
    "kind": "cross",
    "ok": True,
    "layer": "attn2",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "diffusers Attention + AttnProcessor2_0 cross-attention (attn2 of a BasicTransformerBlock): to_q on "
    "64-wide hidden states, to_k/to_v on 48-wide encoder_hidden_states, to_out[0] Linear + Dropout",
}
