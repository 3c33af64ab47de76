"""BLIP/ALBEF text decoder BertSelfAttention with a -10000 extended causal mask; bug: sigmoid instead of softmax for the weights."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        x = x.view(*(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)))
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(self.query(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        # gated ("sigmoid") attention probabilities
        attention_probs = torch.sigmoid(attention_scores)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return (context_layer,)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        return (self.output(self.self(hidden_states, attention_mask)[0], hidden_states),)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = nn.Sequential(
            nn.Linear(config.hidden_size, 2 * config.hidden_size), nn.GELU()
        )
        self.output = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        a = self.attention(hidden_states, attention_mask)[0]
        return (self.output_norm(self.output(self.intermediate(a)) + a),)


class TextDecoderStub(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = BertLayer(config)

    def forward(self, hidden_states):
        batch_size, seq_length = hidden_states.shape[:2]
        seq_ids = torch.arange(seq_length)
        causal = (
            seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        ).float()
        extended = (1.0 - causal[:, None, :, :]) * -10000.0
        return self.layer(hidden_states, extended)[0]


def make_text_decoder():
    config = SimpleNamespace(
        hidden_size=12,
        num_attention_heads=2,
        attention_probs_dropout_prob=0.0,
        layer_norm_eps=1e-12,
    )
    return TextDecoderStub(config)


EXPECT = {
    "target": "make_text_decoder",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
    "layer": "layer.attention.self",
    "style": "BLIP/ALBEF text decoder BertSelfAttention (sigmoid weights)",
}
