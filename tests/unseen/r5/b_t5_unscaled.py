"""T5 block as designed (no 1/sqrt(d_kv) scale in the attention); held to textbook attention this is a missing scale."""

from types import SimpleNamespace

import torch
from torch import nn


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class T5Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d_model = config.d_model
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.num_heads
        self.dropout = config.dropout_rate
        self.inner_dim = self.n_heads * self.key_value_proj_dim
        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)

    def forward(self, hidden_states, mask=None, position_bias=None):
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

        # T5 folds the scale into its initialisation and never divides here
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        if position_bias is None:
            position_bias = torch.zeros(
                (1, self.n_heads, seq_length, seq_length), dtype=scores.dtype
            )
            if mask is not None:
                position_bias = position_bias + mask
        scores += position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = self.o(unshape(torch.matmul(attn_weights, value_states)))
        return (attn_output, position_bias)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.SelfAttention = T5Attention(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        attention_output = self.SelfAttention(
            self.layer_norm(hidden_states), attention_mask, position_bias
        )
        return (hidden_states + self.dropout(attention_output[0]),) + attention_output[1:]


class T5DenseActDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, hidden_states):
        return self.wo(nn.functional.relu(self.wi(hidden_states)))


class T5LayerFF(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.DenseReluDense = T5DenseActDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states):
        return hidden_states + self.DenseReluDense(self.layer_norm(hidden_states))


class T5Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([T5LayerSelfAttention(config), T5LayerFF(config)])

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.layer[0](hidden_states, attention_mask=attention_mask)[0]
        return (self.layer[-1](hidden_states),)


def make_block():
    config = SimpleNamespace(
        d_model=12, d_kv=6, num_heads=2, d_ff=24, dropout_rate=0.0, layer_norm_epsilon=1e-6
    )
    return T5Block(config)


EXPECT = {
    "target": "make_block",
    "kind": "multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "layer": "layer.0.SelfAttention",
    "style": "T5 encoder block (T5Block.layer[0].SelfAttention), unscaled by design",
}
