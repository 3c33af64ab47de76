"""T5Gemma-style decoder cross-attention: queries from the decoder (hidden 64), keys/values from encoder states of
another width (48), GQA 4:2, scaling query_pre_attn_scalar**-0.5, no rotary, no causal mask."""

from types import SimpleNamespace

import torch
from torch import nn


def repeat_kv(hidden_states, n_rep):
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d): kv head g serves query heads g * n_rep ... g * n_rep + n_rep - 1."""
    if n_rep == 1:
        return hidden_states
    b, kv_heads, s, d = hidden_states.shape
    return hidden_states.unsqueeze(2).expand(b, kv_heads, n_rep, s, d).flatten(1, 2)


def eager_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None
):
    if scaling is None:
        scaling = module.head_dim**-0.5
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class T5GemmaCrossAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        self.q_proj = nn.Linear(
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.k_proj = nn.Linear(
            config.cross_attention_hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.v_proj = nn.Linear(
            config.cross_attention_hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
        )
        self.attn_logit_softcapping = config.attn_logit_softcapping

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        if encoder_hidden_states is None:
            raise ValueError("Encoder hidden state is required for cross attention.")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        encoder_input_shape = encoder_hidden_states.shape[:-1]
        encoder_hidden_shape = (*encoder_input_shape, -1, self.head_dim)
        key_states = self.k_proj(encoder_hidden_states).view(encoder_hidden_shape).transpose(1, 2)
        value_states = self.v_proj(encoder_hidden_states).view(encoder_hidden_shape).transpose(1, 2)

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            encoder_attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            softcap=self.attn_logit_softcapping,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


def make_cross_attention():
    config = SimpleNamespace(
        hidden_size=64,
        cross_attention_hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        attention_bias=False,
        attention_dropout=0.0,
        attn_logit_softcapping=None,
    )
    return T5GemmaCrossAttention(config)


EXPECT = {
    "target": "make_cross_attention",
    "kind": "cross",
    "ok": True,
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF T5GemmaCrossAttention (k_proj/v_proj from cross_attention_hidden_size=48, GQA repeat_kv, scaling=query_pre_attn_scalar**-0.5 with query_pre_attn_scalar=head_dim, eager_attention_forward with softcap=None)",
}
