"""ViLT layer (ViltAttention -> ViltSelfAttention + ViltSelfOutput); bug: scores computed as keys times queries."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class ViltSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size, bias=config.qkv_bias)
        self.key = nn.Linear(config.hidden_size, self.all_head_size, bias=config.qkv_bias)
        self.value = nn.Linear(config.hidden_size, self.all_head_size, bias=config.qkv_bias)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(self.query(hidden_states))

        attention_scores = torch.matmul(key_layer, query_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return (context_layer, attention_probs) if output_attentions else (context_layer,)


class ViltSelfOutput(nn.Module):
    """The residual is added in ViltLayer, not here."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.dropout(self.dense(hidden_states))


class ViltAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = ViltSelfAttention(config)
        self.output = ViltSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        self_outputs = self.attention(hidden_states, attention_mask)
        return (self.output(self_outputs[0], hidden_states),) + self_outputs[1:]


class ViltLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = ViltAttention(config)
        self.intermediate = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU()
        )
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm_before = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(self.layernorm_before(hidden_states), attention_mask)[0]
        hidden_states = attention_output + hidden_states
        layer_output = (
            self.output(self.intermediate(self.layernorm_after(hidden_states))) + hidden_states
        )
        return (layer_output,)


def make_layer():
    config = SimpleNamespace(
        hidden_size=20,
        num_attention_heads=4,
        intermediate_size=40,
        qkv_bias=True,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        layer_norm_eps=1e-12,
    )
    return ViltLayer(config)


EXPECT = {
    "target": "make_layer",
    "kind": "multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "scores_transposed",
    "layer": "attention.attention",
    "style": "ViLT ViltLayer -> ViltAttention.attention (keys @ queries^T)",
}
