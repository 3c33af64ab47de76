"""SegFormer (MiT) encoder layer, stage with sequence_reduction_ratio 1.

SegformerEfficientSelfAttention with sr_ratio 1 has no spatial reduction: keys and values
come from the same tokens as the queries. Its output is the merged context layer; the
dense projection lives in SegformerSelfOutput (like BERT), so the self module has no
output projection of its own. The layer receives (hidden_states, height, width); the
wrapper flattens a 1 x n "image".
"""

import math

import torch
from torch import nn


class SegformerEfficientSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, sequence_reduction_ratio):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = int(self.hidden_size / self.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(self.hidden_size, self.all_head_size)
        self.key = nn.Linear(self.hidden_size, self.all_head_size)
        self.value = nn.Linear(self.hidden_size, self.all_head_size)
        self.sr_ratio = sequence_reduction_ratio
        if sequence_reduction_ratio > 1:
            self.sr = nn.Conv2d(
                hidden_size,
                hidden_size,
                kernel_size=sequence_reduction_ratio,
                stride=sequence_reduction_ratio,
            )
            self.layer_norm = nn.LayerNorm(hidden_size)

    def transpose_for_scores(self, hidden_states):
        new_shape = hidden_states.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        hidden_states = hidden_states.view(new_shape)
        return hidden_states.permute(0, 2, 1, 3)

    def forward(self, hidden_states, height, width):
        query_layer = self.transpose_for_scores(self.query(hidden_states))

        if self.sr_ratio > 1:
            batch_size, seq_len, num_channels = hidden_states.shape
            hidden_states = hidden_states.permute(0, 2, 1).reshape(
                batch_size, num_channels, height, width
            )
            hidden_states = self.sr(hidden_states)
            hidden_states = hidden_states.reshape(batch_size, num_channels, -1).permute(0, 2, 1)
            hidden_states = self.layer_norm(hidden_states)

        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(new_context_layer_shape)
        return (context_layer,)


class SegformerSelfOutput(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states):
        return self.dense(hidden_states)


class SegformerAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, sequence_reduction_ratio):
        super().__init__()
        self.self = SegformerEfficientSelfAttention(
            hidden_size, num_attention_heads, sequence_reduction_ratio
        )
        self.output = SegformerSelfOutput(hidden_size)

    def forward(self, hidden_states, height, width):
        self_outputs = self.self(hidden_states, height, width)
        return (self.output(self_outputs[0]),)


class SegformerLayerAttnOnly(nn.Module):
    def __init__(self, hidden_size=64, num_attention_heads=4, sequence_reduction_ratio=1):
        super().__init__()
        self.layer_norm_1 = nn.LayerNorm(hidden_size)
        self.attention = SegformerAttention(
            hidden_size, num_attention_heads, sequence_reduction_ratio
        )

    def forward(self, hidden_states):
        height, width = 1, hidden_states.shape[1]
        attn = self.attention(self.layer_norm_1(hidden_states), height, width)[0]
        return attn + hidden_states


def make_segformer_layer():
    torch.manual_seed(104)
    layer = SegformerLayerAttnOnly()
    with torch.no_grad():
        layer.layer_norm_1.weight.uniform_(0.5, 1.5)
        layer.layer_norm_1.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_segformer_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "attention.self",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF SegFormer SegformerEfficientSelfAttention with sequence_reduction_ratio 1 (no spatial reduction), "
    "transpose_for_scores, no output projection of its own (dense lives in SegformerSelfOutput), (hidden, height, width) call",
}
