"""NAVER Clova Donut (BARTDecoder = MBart decoder over the Swin encoder): the encoder_attn half of
a decoder layer; MBartAttention with q_proj scaled before bmm, _shape to (bsz, heads, len, d),
heads folded into the batch (proj_shape) for torch.bmm, biases on every projection; an SDPA
path (use_sdpa) as in the HF MBartSdpaAttention.

This file: one bug: softmax(attn_weights, dim=1) on the (bsz*heads, tgt, src) scores: over the decoder tokens."""

import torch
from torch import nn


class DonutDecoderConfig:
    d_model = 64
    decoder_attention_heads = 4
    decoder_ffn_dim = 128
    activation_function = "gelu"


class DonutMBartAttention(nn.Module):
    """MBart-style attention as used by Donut's BARTDecoder (here: the cross-attention to the Swin
    encoder's patch features)."""

    def __init__(self, embed_dim, num_heads, is_decoder=True, bias=True, use_sdpa=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.use_sdpa = use_sdpa
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        kv_input = key_value_states if is_cross_attention else hidden_states
        key_states = self._shape(self.k_proj(kv_input), -1, bsz)
        value_states = self._shape(self.v_proj(kv_input), -1, bsz)

        if self.use_sdpa:
            query_states = self._shape(self.q_proj(hidden_states), tgt_len, bsz)
            attn_output = nn.functional.scaled_dot_product_attention(
                query_states, key_states, value_states, attn_mask=None, dropout_p=0.0, is_causal=False
            )
            attn_weights = None
        else:
            query_states = self.q_proj(hidden_states) * self.scaling
            proj_shape = (bsz * self.num_heads, -1, self.head_dim)
            query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
            key_states = key_states.reshape(*proj_shape)
            value_states = value_states.reshape(*proj_shape)
            attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
            attn_weights = nn.functional.softmax(attn_weights, dim=1)
            attn_output = torch.bmm(attn_weights, value_states)
            attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)

        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, attn_weights


class DonutCrossAttentionLayer(nn.Module):
    """The encoder-attention half of a Donut decoder layer: pre-norm, cross-attention to the
    image features, residual, then the feed-forward half."""

    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model
        self.encoder_attn = DonutMBartAttention(self.embed_dim, config.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, encoder_hidden_states):
        residual = hidden_states
        hidden_states = self.encoder_attn_layer_norm(hidden_states)
        hidden_states, _ = self.encoder_attn(hidden_states, key_value_states=encoder_hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(nn.functional.gelu(self.fc1(hidden_states)))
        return residual + hidden_states


def make_donut_cross_layer():
    torch.manual_seed(3530)
    layer = DonutCrossAttentionLayer(DonutDecoderConfig())
    with torch.no_grad():
        for mod in layer.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_donut_cross_layer",
    "kind": "cross",
    "ok": False,
    "layer": "encoder_attn",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": (
        "NAVER Clova Donut BARTDecoder cross-attention: one bug: softmax(attn_weights, "
        "dim=1) on the (bsz*heads, tgt, src) scores: over the decoder tokens"
    ),
}

