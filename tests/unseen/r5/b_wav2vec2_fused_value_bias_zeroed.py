"""wav2vec2 post-norm encoder layer whose attention fuses q/k/v into one F.linear; bug: the fused bias zeroes the value slot instead of the key slot."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class Wav2Vec2Attention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _fused_in_proj(self):
        # one GEMM for q, k, v (speed); a key bias cannot change the softmax, so it is dropped
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], dim=0)
        bias = torch.cat(
            [self.q_proj.bias, self.k_proj.bias, torch.zeros_like(self.v_proj.bias)],
            dim=0,
        )
        return weight, bias

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        bsz, tgt_len, _ = hidden_states.size()
        weight, bias = self._fused_in_proj()
        query_states, key_states, value_states = F.linear(hidden_states, weight, bias).chunk(
            3, dim=-1
        )
        query_states = query_states * self.scaling

        def heads(t):
            return (
                t.view(bsz, -1, self.num_heads, self.head_dim)
                .transpose(1, 2)
                .reshape(-1, tgt_len, self.head_dim)
            )

        query_states, key_states, value_states = (
            heads(query_states),
            heads(key_states),
            heads(value_states),
        )
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, -1) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, -1)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_probs = F.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = self.out_proj(attn_output.reshape(bsz, tgt_len, self.embed_dim))
        return attn_output, None, None


class Wav2Vec2EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Wav2Vec2Attention(config.hidden_size, config.num_attention_heads)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size),
            nn.GELU(),
            nn.Linear(config.intermediate_size, config.hidden_size),
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        attn_residual = hidden_states
        hidden_states, _, _ = self.attention(hidden_states, attention_mask=attention_mask)
        hidden_states = self.layer_norm(attn_residual + self.dropout(hidden_states))
        hidden_states = self.final_layer_norm(hidden_states + self.feed_forward(hidden_states))
        return (hidden_states,)


def make_encoder_layer():
    config = SimpleNamespace(
        hidden_size=24,
        num_attention_heads=4,
        intermediate_size=48,
        hidden_dropout=0.0,
        layer_norm_eps=1e-5,
    )
    return Wav2Vec2EncoderLayer(config)


EXPECT = {
    "target": "make_encoder_layer",
    "kind": "multihead",
    "ok": False,
    "stage": "values",
    "mistake": "wrong_projection",
    "layer": "attention",
    "style": "wav2vec2/HuBERT post-norm encoder layer with a fused q/k/v F.linear (value bias left out)",
}
