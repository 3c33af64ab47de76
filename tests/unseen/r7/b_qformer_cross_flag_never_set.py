"""BLIP-2 Q-Former-style cross-attention sublayer; bug: __init__ stores the flag as `is_cross_attention` but forward
reads the class default `uses_encoder_states = False`, so keys and values come from the query tokens
(encoder width equals hidden size here, so the shapes still fit)."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class QFormerMultiHeadAttention(nn.Module):
    uses_encoder_states = False

    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.is_cross_attention = is_cross_attention
        kv_width = config.encoder_hidden_size if is_cross_attention else config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(kv_width, self.all_head_size)
        self.value = nn.Linear(kv_width, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
    ):
        kv_states = encoder_hidden_states if self.uses_encoder_states else hidden_states
        if self.uses_encoder_states:
            attention_mask = encoder_attention_mask
        key_layer = self.transpose_for_scores(self.key(kv_states))
        value_layer = self.transpose_for_scores(self.value(kv_states))
        query_layer = self.transpose_for_scores(self.query(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        context_layer = torch.matmul(self.dropout(attention_probs), value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(*context_layer.size()[:-2], self.all_head_size)
        return context_layer, attention_probs


class QFormerSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class QFormerAttention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.attention = QFormerMultiHeadAttention(config, is_cross_attention)
        self.output = QFormerSelfOutput(config)

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_attention_mask=None):
        context, probs = self.attention(
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
        )
        return self.output(context, hidden_states), probs


def make_crossattention():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        encoder_hidden_size=64,
        layer_norm_eps=1e-12,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    return QFormerAttention(config, is_cross_attention=True)


EXPECT = {
    "target": "make_crossattention",
    "kind": "cross",
    "ok": False,
    "stage": "keys",
    "mistake": "wrong_source",
    "layer": "attention",
    "style": "BLIP-2/InstructBLIP Q-Former crossattention sublayer (query/key/value + transpose_for_scores, SelfOutput dense + LayerNorm); forward reads a never-set class flag, so k/v come from hidden_states",
}
