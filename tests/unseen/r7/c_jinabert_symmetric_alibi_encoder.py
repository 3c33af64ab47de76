"""JinaBERT-style bidirectional encoder layer: symmetric ALiBi (-slope * |i - j|) kept as a buffer in the encoder, no position embeddings."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class JinaBertSelfAttention(nn.Module):
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
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, bias=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores + bias, dim=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return (context_layer.view(new_context_layer_shape),)


class JinaBertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class JinaBertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = JinaBertSelfAttention(config)
        self.output = JinaBertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, bias=None):
        self_outputs = self.self(hidden_states, attention_mask, bias=bias)
        return (self.output(self_outputs[0], hidden_states),) + self_outputs[1:]


class JinaBertGLUMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gated_layers = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.act = nn.GELU()
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual = hidden_states
        gated, non_gated = self.gated_layers(hidden_states).chunk(2, dim=-1)
        return self.layernorm(self.wo(self.act(gated) * non_gated) + residual)


class JinaBertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = JinaBertAttention(config)
        self.mlp = JinaBertGLUMLP(config)

    def forward(self, hidden_states, attention_mask=None, bias=None):
        attention_output = self.attention(hidden_states, attention_mask, bias=bias)[0]
        return self.mlp(attention_output)


class JinaBertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList([JinaBertLayer(config) for _ in range(config.num_hidden_layers)])
        self.num_attention_heads = config.num_attention_heads
        self.register_buffer(
            "alibi",
            self.rebuild_alibi_tensor(size=config.max_position_embeddings),
            persistent=False,
        )

    @staticmethod
    def _get_alibi_head_slopes(n_heads):
        def get_slopes_power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**i for i in range(n)]

        if math.log2(n_heads).is_integer():
            return get_slopes_power_of_2(n_heads)
        closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
        return (
            get_slopes_power_of_2(closest_power_of_2)
            + JinaBertEncoder._get_alibi_head_slopes(2 * closest_power_of_2)[0::2][
                : n_heads - closest_power_of_2
            ]
        )

    def rebuild_alibi_tensor(self, size, device=None):
        n_heads = self.num_attention_heads
        context_position = torch.arange(size, device=device)[:, None]
        memory_position = torch.arange(size, device=device)[None, :]
        relative_position = torch.abs(memory_position - context_position)
        relative_position = relative_position.unsqueeze(0).expand(n_heads, -1, -1)
        slopes = torch.tensor(self._get_alibi_head_slopes(n_heads), device=device) * -1
        alibi = slopes.unsqueeze(1).unsqueeze(1) * relative_position
        return alibi.unsqueeze(0)  # (1, heads, size, size)

    def forward(self, hidden_states, attention_mask=None):
        seqlen = hidden_states.shape[1]
        if self.alibi.shape[-1] < seqlen:
            self.register_buffer(
                "alibi",
                self.rebuild_alibi_tensor(size=seqlen, device=hidden_states.device),
                persistent=False,
            )
        alibi_bias = self.alibi[:, :, :seqlen, :seqlen].to(hidden_states.dtype)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, bias=alibi_bias)
        return hidden_states


def make_encoder():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=8,
        intermediate_size=128,
        num_hidden_layers=1,
        max_position_embeddings=16,
        layer_norm_eps=1e-12,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    return JinaBertEncoder(config)


EXPECT = {
    "target": "make_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "layer.0.attention.self",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "alibi",
    },
    "style": "JinaBERT (jina-bert-v2) encoder: BertSelfAttention without position embeddings, symmetric ALiBi buffer -slope*|j-i| rebuilt when longer, added inside softmax(scores + bias); output dense lives in SelfOutput",
}
