"""T5-style layer (q/k/v/o without bias, shape/unshape, zero position bias) rewritten WITH the 1/sqrt(d_kv) scale."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class T5LayerNorm(nn.Module):
    """RMS norm without mean subtraction and without bias, as T5 does."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class T5Attention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        if has_relative_attention_bias:
            raise NotImplementedError("this rewrite keeps only the plain layers")
        self.d_model = config.d_model
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.num_heads
        self.dropout = config.dropout_rate
        self.inner_dim = self.n_heads * self.key_value_proj_dim

        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)

    def forward(self, hidden_states, mask=None, position_bias=None, output_attentions=False):
        batch_size, seq_length = hidden_states.shape[:2]

        def shape(states):
            return states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(
                1, 2
            )

        def unshape(states):
            return states.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)

        query_states = shape(self.q(hidden_states))
        key_states = shape(self.k(hidden_states))
        value_states = shape(self.v(hidden_states))

        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        # the original T5 leaves this out on purpose; this port uses the textbook scale
        scores = scores / math.sqrt(self.key_value_proj_dim)

        if position_bias is None:
            position_bias = torch.zeros(
                (1, self.n_heads, seq_length, seq_length), device=scores.device, dtype=scores.dtype
            )
            if mask is not None:
                position_bias = position_bias + mask
        scores += position_bias

        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = unshape(torch.matmul(attn_weights, value_states))
        attn_output = self.o(attn_output)

        outputs = (attn_output, position_bias)
        if output_attentions:
            outputs = outputs + (attn_weights,)
        return outputs


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.SelfAttention = T5Attention(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        normed = self.layer_norm(hidden_states)
        attention_output = self.SelfAttention(
            normed, mask=attention_mask, position_bias=position_bias
        )
        hidden_states = hidden_states + self.dropout(attention_output[0])
        return (hidden_states,) + attention_output[1:]


def make_layer():
    config = SimpleNamespace(
        d_model=20, d_kv=5, num_heads=4, dropout_rate=0.0, layer_norm_epsilon=1e-6
    )
    return T5LayerSelfAttention(config)


EXPECT = {
    "target": "make_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "SelfAttention",
    "style": "T5 LayerSelfAttention (RMS norm + SelfAttention), rewritten with the 1/sqrt(d_kv) scale",
}
