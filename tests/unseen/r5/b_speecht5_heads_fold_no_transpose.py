"""SpeechT5 encoder layer (position_bias=None); bug: _shape folds heads into the batch with a bare view(bsz*heads, seq, d), no transpose."""

from types import SimpleNamespace

import torch
from torch import nn


class SpeechT5Attention(nn.Module):
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
        # (bsz, seq, embed) -> (bsz * heads, seq, head_dim)
        return tensor.contiguous().view(bsz * self.num_heads, seq_len, self.head_dim)

    def forward(
        self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False
    ):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self._shape(self.q_proj(hidden_states) * self.scaling, tgt_len, bsz)
        key_states = self._shape(self.k_proj(hidden_states), tgt_len, bsz)
        value_states = self._shape(self.v_proj(hidden_states), tgt_len, bsz)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))

        if position_bias is not None:
            reshape_q = (
                query_states.contiguous()
                .view(bsz * self.num_heads, -1, self.head_dim)
                .transpose(0, 1)
            )
            rel_pos_bias = torch.matmul(reshape_q, position_bias.transpose(-2, -1))
            attn_weights += rel_pos_bias.transpose(0, 1).view(
                bsz * self.num_heads, tgt_len, src_len
            )
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), None


class SpeechT5EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = SpeechT5Attention(config.hidden_size, config.encoder_attention_heads)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = nn.Sequential(
            nn.Linear(config.hidden_size, config.encoder_ffn_dim),
            nn.GELU(),
            nn.Linear(config.encoder_ffn_dim, config.hidden_size),
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        residual = hidden_states
        hidden_states, _ = self.attention(
            hidden_states, attention_mask=attention_mask, position_bias=position_bias
        )
        hidden_states = self.layer_norm(residual + self.dropout(hidden_states))
        hidden_states = self.final_layer_norm(hidden_states + self.feed_forward(hidden_states))
        return (hidden_states,)


def make_encoder_layer():
    config = SimpleNamespace(
        hidden_size=12,
        encoder_attention_heads=2,
        encoder_ffn_dim=24,
        hidden_dropout=0.0,
        layer_norm_eps=1e-5,
    )
    return SpeechT5EncoderLayer(config)


EXPECT = {
    "target": "make_encoder_layer",
    "kind": "multihead",
    "ok": False,
    "stage": "queries",
    "mistake": "heads_split",
    "layer": "attention",
    "style": "SpeechT5 encoder layer/attention (heads folded into batch by a bare view)",
}
