"""MPNet-style encoder: a learned relative position bias (nn.Embedding of 32 bidirectional log buckets per head)
computed once by the encoder and added to every layer's scaled scores. Correct, but the bias is a learned table."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class MPNetSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.q = nn.Linear(config.hidden_size, self.all_head_size)
        self.k = nn.Linear(config.hidden_size, self.all_head_size)
        self.v = nn.Linear(config.hidden_size, self.all_head_size)
        self.o = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        q = self.transpose_for_scores(self.q(hidden_states))
        k = self.transpose_for_scores(self.k(hidden_states))
        v = self.transpose_for_scores(self.v(hidden_states))

        attention_scores = torch.matmul(q, k.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if position_bias is not None:
            attention_scores = attention_scores + position_bias
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)

        c = torch.matmul(attention_probs, v)
        c = c.permute(0, 2, 1, 3).contiguous()
        c = c.view(*c.size()[:-2], self.all_head_size)
        return self.o(c), attention_probs


class MPNetAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = MPNetSelfAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        self_outputs = self.attn(hidden_states, attention_mask, position_bias=position_bias)
        return self.LayerNorm(self.dropout(self_outputs[0]) + hidden_states)


class MPNetLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = MPNetAttention(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        attention_output = self.attention(
            hidden_states, attention_mask, position_bias=position_bias
        )
        hidden = self.output_dense(nn.functional.gelu(self.intermediate(attention_output)))
        return self.output_norm(hidden + attention_output)


class MPNetEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_heads = config.num_attention_heads
        self.layer = nn.ModuleList([MPNetLayer(config) for _ in range(config.num_hidden_layers)])
        self.relative_attention_bias = nn.Embedding(
            config.relative_attention_num_buckets, self.n_heads
        )

    def forward(self, hidden_states, attention_mask=None):
        position_bias = self.compute_position_bias(hidden_states)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, position_bias=position_bias)
        return hidden_states

    def compute_position_bias(self, x, position_ids=None, num_buckets=32):
        bsz, qlen, klen = x.size(0), x.size(1), x.size(1)
        if position_ids is not None:
            context_position = position_ids[:, :, None]
            memory_position = position_ids[:, None, :]
        else:
            context_position = torch.arange(qlen, dtype=torch.long, device=x.device)[:, None]
            memory_position = torch.arange(klen, dtype=torch.long, device=x.device)[None, :]
        relative_position = memory_position - context_position
        rp_bucket = self.relative_position_bucket(relative_position, num_buckets=num_buckets)
        values = self.relative_attention_bias(rp_bucket)
        values = values.permute([2, 0, 1]).unsqueeze(0)
        return values.expand((bsz, -1, qlen, klen)).contiguous().to(x.dtype)

    @staticmethod
    def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        """Bidirectional T5-style buckets: half of them for keys after the query; within each half, exact
        distances below a quarter of the buckets, then logarithmic bins up to max_distance."""
        half = num_buckets // 2
        bucket = (relative_position > 0).long() * half
        distance = relative_position.abs()
        exact = half // 2
        log_bin = (
            exact
            + (
                torch.log(distance.float() / exact)
                / math.log(max_distance / exact)
                * (half - exact)
            ).long()
        )
        log_bin = log_bin.clamp(max=half - 1)
        return bucket + torch.where(distance < exact, distance, log_bin)


def make_encoder():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        num_hidden_layers=1,
        relative_attention_num_buckets=32,
        layer_norm_eps=1e-12,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    return MPNetEncoder(config)


EXPECT = {
    "target": "make_encoder",
    "kind": "multihead",
    "ok": True,
    "unsupported": "relative_bias",
    "layer": "layer.0.attention.attn",
    "style": "HF MPNetEncoder/MPNetSelfAttention (q/k/v/o, relative_attention_bias Embedding(32, heads) over T5-style bidirectional log buckets, position_bias added after the 1/sqrt(d) scale)",
}
