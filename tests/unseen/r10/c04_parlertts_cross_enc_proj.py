"""Parler-TTS decoder cross-attention block, written from scratch.

The text-encoder states (48 wide) go through the model's enc_to_dec_proj to the decoder width
(64) and feed ParlerTTSAttention as key_value_states. BART lineage: queries scaled right after
q_proj, heads folded into the batch with _shape(...).view(bsz * heads, -1, head_dim), bmm,
softmax, bmm, out_proj. Cross-attention has no rotary in Parler-TTS.
"""

import torch
from torch import nn


class ParlerTTSAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=False, is_decoder=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, **kwargs):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        current_states = key_value_states if is_cross_attention else hidden_states
        key_states = self._shape(self.k_proj(current_states), -1, bsz)
        value_states = self._shape(self.v_proj(current_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)

        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, None, None


class ParlerTTSCrossBlock(nn.Module):
    """The cross-attention half of a ParlerTTSDecoderLayer plus the model's enc_to_dec_proj."""

    def __init__(self, d_model=64, encoder_hidden_size=48, heads=4):
        super().__init__()
        self.enc_to_dec_proj = nn.Linear(encoder_hidden_size, d_model)
        self.encoder_attn = ParlerTTSAttention(d_model, heads, bias=False, is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden_states, encoder_hidden_states):
        encoder_hidden_states = self.enc_to_dec_proj(encoder_hidden_states)
        residual = hidden_states
        hidden_states = self.encoder_attn_layer_norm(hidden_states)
        hidden_states, _, _ = self.encoder_attn(
            hidden_states=hidden_states,
            key_value_states=encoder_hidden_states,
            attention_mask=None,
        )
        return residual + hidden_states


def make_parler_cross():
    torch.manual_seed(1004)
    block = ParlerTTSCrossBlock()
    with torch.no_grad():
        block.encoder_attn_layer_norm.weight.uniform_(0.5, 1.5)
        block.encoder_attn_layer_norm.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_parler_cross",
    "kind": "cross",
    "ok": True,
    "layer": "encoder_attn",
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
    "style": "Parler-TTS cross-attention (ParlerTTSAttention, BART lineage: q_proj(x) * scaling, _shape + bmm on (bsz*heads) folds, "
    "out_proj) behind the model's enc_to_dec_proj 48 -> 64 and a pre-LayerNorm residual block",
}
