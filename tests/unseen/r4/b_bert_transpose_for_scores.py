"""BERT-style self-attention; bug: transpose_for_scores views (batch, seq, hidden) directly as (batch, heads, seq, head_size), cutting heads across tokens."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        # (batch, seq, all_head_size) -> (batch, heads, seq, head_size)
        return x.view(x.size(0), self.num_attention_heads, -1, self.attention_head_size)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        if head_mask is not None:
            attention_probs = attention_probs * head_mask

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(new_context_layer_shape)
        return (context_layer, attention_probs) if output_attentions else (context_layer,)


def make_bert_self_attention():
    config = SimpleNamespace(
        hidden_size=12, num_attention_heads=3, attention_probs_dropout_prob=0.0
    )
    return BertSelfAttention(config)


EXPECT = {
    "target": "make_bert_self_attention",
    "kind": "multihead",
    "ok": False,
    "stage": "queries",
    "mistake": "heads_split",
    "style": "BERT BertSelfAttention (transpose_for_scores)",
}
