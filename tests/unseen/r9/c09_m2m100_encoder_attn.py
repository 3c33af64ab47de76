"""M2M100 / NLLB decoder layer, encoder-decoder attention sublayer (encoder_attn).

Pre-norm (encoder_attn_layer_norm) cross-attention: queries from the decoder states,
keys and values from encoder_hidden_states of another length; q_proj output multiplied
by scaling, (bsz * heads) bmm, biased projections, out_proj. 8 heads of 8.
"""

import torch
from torch import nn


class M2M100Attention(nn.Module):
    def __init__(
        self, embed_dim, num_heads, dropout=0.0, is_decoder=False, bias=True, is_causal=False
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.is_causal = is_causal
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len = hidden_states.shape[:-1]
        src_len = key_value_states.shape[1] if is_cross_attention else tgt_len
        q_input_shape = (bsz, tgt_len, -1, self.head_dim)
        kv_input_shape = (bsz, src_len, -1, self.head_dim)

        query_states = (
            (self.q_proj(hidden_states) * self.scaling).view(*q_input_shape).transpose(1, 2)
        )
        current_states = key_value_states if is_cross_attention else hidden_states
        key_states = self.k_proj(current_states).view(*kv_input_shape).transpose(1, 2)
        value_states = self.v_proj(current_states).view(*kv_input_shape).transpose(1, 2)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = query_states.reshape(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)

        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, None


class M2M100CrossSublayer(nn.Module):
    """The encoder-attention half of M2M100DecoderLayer."""

    def __init__(self, d_model=64, decoder_attention_heads=8):
        super().__init__()
        self.encoder_attn = M2M100Attention(d_model, decoder_attention_heads, is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        residual = hidden_states
        hidden_states = self.encoder_attn_layer_norm(hidden_states)
        hidden_states, _ = self.encoder_attn(
            hidden_states=hidden_states,
            key_value_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
        )
        return residual + hidden_states


def make_m2m100_cross():
    torch.manual_seed(109)
    blk = M2M100CrossSublayer()
    with torch.no_grad():
        blk.encoder_attn_layer_norm.weight.uniform_(0.5, 1.5)
        blk.encoder_attn_layer_norm.bias.uniform_(-0.1, 0.1)
    return blk.eval()


EXPECT = {
    "target": "make_m2m100_cross",
    "kind": "cross",
    "ok": True,
    "layer": "encoder_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF M2M100/NLLB decoder encoder_attn sublayer (pre-norm, key_value_states keyword, q_proj * scaling, "
    "bmm over bsz*heads, biased projections)",
}
