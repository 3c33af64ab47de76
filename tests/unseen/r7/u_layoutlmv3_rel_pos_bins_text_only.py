"""LayoutLMv3-style text-only encoder: 1D relative position bias from a bias-free Linear over one-hot log buckets
(rel_pos_bins=32), divided by sqrt(head_dim) and added to the scores, CogView-stabilized softmax. Correct, but the
bias is a learned bucketed table."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class LayoutLMv3SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.has_relative_attention_bias = config.has_relative_attention_bias
        self.has_spatial_attention_bias = config.has_spatial_attention_bias

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def cogview_attention(self, attention_scores, alpha=32):
        """PB-Relax: softmax(x) computed as softmax((x / alpha - max(x / alpha)) * alpha)."""
        scaled_attention_scores = attention_scores / alpha
        max_value = scaled_attention_scores.amax(dim=(-1)).unsqueeze(-1)
        new_attention_scores = (scaled_attention_scores - max_value) * alpha
        return nn.Softmax(dim=-1)(new_attention_scores)

    def forward(self, hidden_states, attention_mask=None, rel_pos=None, rel_2d_pos=None):
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(self.query(hidden_states))

        attention_scores = torch.matmul(
            query_layer / math.sqrt(self.attention_head_size), key_layer.transpose(-1, -2)
        )
        if self.has_relative_attention_bias and self.has_spatial_attention_bias:
            attention_scores = attention_scores + (rel_pos + rel_2d_pos) / math.sqrt(
                self.attention_head_size
            )
        elif self.has_relative_attention_bias:
            attention_scores = attention_scores + rel_pos / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = self.dropout(self.cogview_attention(attention_scores))
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(*context_layer.size()[:-2], self.all_head_size), attention_probs


class LayoutLMv3SelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class LayoutLMv3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = LayoutLMv3SelfAttention(config)
        self.output = LayoutLMv3SelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, rel_pos=None):
        self_outputs = self.self(hidden_states, attention_mask, rel_pos=rel_pos)
        return self.output(self_outputs[0], hidden_states)


class LayoutLMv3Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = LayoutLMv3Attention(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, rel_pos=None):
        attention_output = self.attention(hidden_states, attention_mask, rel_pos=rel_pos)
        layer_output = self.output_dense(F.gelu(self.intermediate(attention_output)))
        return self.output_norm(layer_output + attention_output)


class LayoutLMv3Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(
            [LayoutLMv3Layer(config) for _ in range(config.num_hidden_layers)]
        )
        self.rel_pos_bins = config.rel_pos_bins
        self.max_rel_pos = config.max_rel_pos
        self.rel_pos_bias = nn.Linear(self.rel_pos_bins, config.num_attention_heads, bias=False)

    def relative_position_bucket(
        self, relative_position, bidirectional=True, num_buckets=32, max_distance=128
    ):
        if bidirectional:
            num_buckets //= 2
            offset = (relative_position > 0).long() * num_buckets
            distance = relative_position.abs()
        else:
            offset = 0
            distance = (-relative_position).clamp(min=0)
        exact = num_buckets // 2
        scaled = torch.log(distance.float() / exact) / math.log(max_distance / exact)
        far = (exact + (scaled * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
        return offset + torch.where(distance < exact, distance, far)

    def _cal_1d_pos_emb(self, position_ids, dtype):
        rel_pos_mat = position_ids.unsqueeze(-2) - position_ids.unsqueeze(-1)
        rel_pos = self.relative_position_bucket(
            rel_pos_mat, num_buckets=self.rel_pos_bins, max_distance=self.max_rel_pos
        )
        rel_pos = F.one_hot(rel_pos, num_classes=self.rel_pos_bins).to(dtype)
        return self.rel_pos_bias(rel_pos).permute(0, 3, 1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        rel_pos = self._cal_1d_pos_emb(position_ids, hidden_states.dtype)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, rel_pos=rel_pos)
        return hidden_states


def make_text_encoder():
    config = SimpleNamespace(
        hidden_size=48,
        num_attention_heads=3,
        intermediate_size=96,
        num_hidden_layers=1,
        rel_pos_bins=32,
        max_rel_pos=128,
        has_relative_attention_bias=True,
        has_spatial_attention_bias=False,
        layer_norm_eps=1e-5,
        attention_probs_dropout_prob=0.0,
    )
    encoder = LayoutLMv3Encoder(config)
    with torch.no_grad():
        encoder.rel_pos_bias.weight.normal_(0.0, 2.0)  # a trained table is far from zero
    return encoder


EXPECT = {
    "target": "make_text_encoder",
    "kind": "multihead",
    "ok": True,
    "unsupported": "relative_bias",
    "layer": "layer.0.attention.self",
    "style": "HF LayoutLMv3Encoder text path (rel_pos_bias = Linear(rel_pos_bins, heads) over one-hot buckets, rel_pos / sqrt(d) added to q/sqrt(d) @ k^T, cogview_attention softmax, dense in SelfOutput)",
}
