"""Florence-2 (microsoft/Florence-2, modeling_florence2.py) language decoder cross-attention: the
BART-lineage Florence2Attention (q_proj output multiplied by self.scaling before the product,
_shape to (bsz, heads, len, head_dim), folded to (bsz * heads, len, head_dim) for torch.bmm,
softmax, bmm with the values, out_proj), used as the decoder layer's encoder_attn over the encoder
states, post-norm (residual add, then encoder_attn_layer_norm).

This file: correct (4 heads of 16, biased projections, context of any length)."""

import torch
from torch import nn


class Florence2LanguageConfig:
    d_model = 64
    decoder_attention_heads = 4
    attention_dropout = 0.0
    image_feature_width = 64


class Florence2Attention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, is_decoder=False, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)

        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)

        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output


class Florence2DecoderCrossBlock(nn.Module):
    """The encoder-attention half of Florence2DecoderLayer: (hidden_states, encoder_hidden_states)."""

    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model

        self.encoder_attn = Florence2Attention(
            self.embed_dim, config.decoder_attention_heads, dropout=config.attention_dropout, is_decoder=True
        )
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, encoder_hidden_states):

        residual = hidden_states
        hidden_states = self.encoder_attn(
            hidden_states=hidden_states,
            key_value_states=encoder_hidden_states,
        )
        hidden_states = residual + hidden_states
        return self.encoder_attn_layer_norm(hidden_states)


def make_florence2_cross():
    torch.manual_seed(2505)
    block = Florence2DecoderCrossBlock(Florence2LanguageConfig())
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_florence2_cross",
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
    "style": "Florence-2 decoder encoder_attn (BART-lineage bmm attention): correct (4x16)",
}
