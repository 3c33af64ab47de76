"""BLIP/ALBEF med.py text decoder: BertSelfAttention (save_attention hooks) with a causal extended mask of -10000 built by the model."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class BertSelfAttention(nn.Module):
    def __init__(self, config, is_cross_attention):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        if is_cross_attention:
            self.key = nn.Linear(config.encoder_width, self.all_head_size)
            self.value = nn.Linear(config.encoder_width, self.all_head_size)
        else:
            self.key = nn.Linear(config.hidden_size, self.all_head_size)
            self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.save_attention = False

    def save_attn_gradients(self, attn_gradients):
        self.attn_gradients = attn_gradients

    def save_attention_map(self, attention_map):
        self.attention_map = attention_map

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        output_attentions=False,
    ):
        mixed_query_layer = self.query(hidden_states)
        is_cross_attention = encoder_hidden_states is not None
        source = encoder_hidden_states if is_cross_attention else hidden_states
        key_layer = self.transpose_for_scores(self.key(source))
        value_layer = self.transpose_for_scores(self.value(source))
        query_layer = self.transpose_for_scores(mixed_query_layer)

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask

        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        if is_cross_attention and self.save_attention:
            self.save_attention_map(attention_probs)
        attention_probs_dropped = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs_dropped, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(*new_context_layer_shape)

        outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)
        return outputs


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.self = BertSelfAttention(config, is_cross_attention)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        self_outputs = self.self(hidden_states, attention_mask, encoder_hidden_states)
        attention_output = self.output(self_outputs[0], hidden_states)
        return (attention_output,) + self_outputs[1:]


class BertLayer(nn.Module):
    def __init__(self, config, layer_num):
        super().__init__()
        self.layer_num = layer_num
        self.attention = BertAttention(config)
        self.intermediate = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU()
        )
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)[0]
        layer_output = self.output_norm(
            self.output_dense(self.intermediate(attention_output)) + attention_output
        )
        return (layer_output,)


class TextDecoderStub(nn.Module):
    """The bit of BertModel (is_decoder=True) that builds the extended causal mask, with one layer."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer = BertLayer(config, 0)

    def get_extended_attention_mask(self, attention_mask, input_shape, device):
        batch_size, seq_length = input_shape
        seq_ids = torch.arange(seq_length, device=device)
        causal_mask = (
            seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        )
        causal_mask = causal_mask.to(attention_mask.dtype)
        extended = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
        return (1.0 - extended) * -10000.0

    def forward(self, hidden_states, attention_mask=None):
        batch_size, seq_length = hidden_states.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length, device=hidden_states.device)
        extended = self.get_extended_attention_mask(
            attention_mask, (batch_size, seq_length), hidden_states.device
        )
        return self.layer(hidden_states, extended.to(hidden_states.dtype))[0]


def make_text_decoder():
    config = SimpleNamespace(
        hidden_size=24,
        num_attention_heads=4,
        intermediate_size=48,
        encoder_width=24,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        layer_norm_eps=1e-12,
    )
    return TextDecoderStub(config)


EXPECT = {
    "target": "make_text_decoder",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layer.attention.self",
    "style": "BLIP/ALBEF med.py BertSelfAttention in a text decoder (extended causal mask (1 - m) * -10000)",
}
