"""MosaicBERT-style encoder layer (Wqkv, symmetric ALiBi rebuilt by the encoder, no position embeddings, 4 heads);
bug: rebuild_alibi_tensor multiplies the slopes by +|i - j| (the minus sign was dropped), so far tokens are favoured."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
from einops import rearrange


class BertSelfAttention(nn.Module):
    """The padded path of BertUnpadSelfAttention: the whole batch has the same length, nothing to unpad."""

    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.p_dropout = config.attention_probs_dropout_prob
        self.Wqkv = nn.Linear(self.all_head_size, 3 * config.hidden_size)

    def forward(self, hidden_states, bias):
        qkv = self.Wqkv(hidden_states)
        qkv = rearrange(qkv, "b s (t h d) -> b s t h d", t=3, h=self.num_attention_heads)
        q = qkv[:, :, 0, :, :].permute(0, 2, 1, 3)  # b h s d
        k = qkv[:, :, 1, :, :].permute(0, 2, 3, 1)  # b h d s
        v = qkv[:, :, 2, :, :].permute(0, 2, 1, 3)  # b h s d
        attention_scores = torch.matmul(q, k) / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + bias
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = nn.functional.dropout(
            attention_probs, p=self.p_dropout, training=self.training
        )
        attention = torch.matmul(attention_probs, v).permute(0, 2, 1, 3)  # b s h d
        return rearrange(attention, "b s h d -> b s (h d)")


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertUnpadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, bias):
        return self.output(self.self(input_tensor, bias), input_tensor)


class BertGatedLinearUnitMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gated_layers = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.act = nn.GELU(approximate="none")
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual_connection = hidden_states
        hidden_states = self.gated_layers(hidden_states)
        gated = hidden_states[:, :, : self.wo.in_features]
        non_gated = hidden_states[:, :, self.wo.in_features :]
        hidden_states = self.wo(self.act(gated) * non_gated)
        return self.layernorm(hidden_states + residual_connection)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertUnpadAttention(config)
        self.mlp = BertGatedLinearUnitMLP(config)

    def forward(self, hidden_states, bias):
        return self.mlp(self.attention(hidden_states, bias))


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.num_attention_heads = config.num_attention_heads
        self._current_alibi_size = int(config.alibi_starting_size)
        self.alibi = torch.zeros(
            (1, self.num_attention_heads, self._current_alibi_size, self._current_alibi_size)
        )
        self.rebuild_alibi_tensor(size=config.alibi_starting_size)

    def rebuild_alibi_tensor(self, size, device=None):
        n_heads = self.num_attention_heads

        def _get_alibi_head_slopes(n_heads):
            def get_slopes_power_of_2(n_heads):
                start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
                ratio = start
                return [start * ratio**i for i in range(n_heads)]

            if math.log2(n_heads).is_integer():
                return get_slopes_power_of_2(n_heads)
            closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
            slopes_a = get_slopes_power_of_2(closest_power_of_2)
            slopes_b = _get_alibi_head_slopes(2 * closest_power_of_2)
            slopes_b = slopes_b[0::2][: n_heads - closest_power_of_2]
            return slopes_a + slopes_b

        context_position = torch.arange(size, device=device)[:, None]
        memory_position = torch.arange(size, device=device)[None, :]
        relative_position = torch.abs(memory_position - context_position)
        relative_position = relative_position.unsqueeze(0).expand(n_heads, -1, -1)
        slopes = torch.tensor(_get_alibi_head_slopes(n_heads), device=device)
        alibi = slopes.unsqueeze(1).unsqueeze(1) * relative_position
        alibi = alibi.unsqueeze(0)
        self._current_alibi_size = size
        self.alibi = alibi

    def forward(self, hidden_states, attention_mask=None):
        batch, seqlen = hidden_states.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(
                batch, seqlen, dtype=hidden_states.dtype, device=hidden_states.device
            )
        extended_attention_mask = (
            1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)
        ) * -10000.0
        if self._current_alibi_size < seqlen:
            self.rebuild_alibi_tensor(size=seqlen, device=hidden_states.device)
        alibi_bias = self.alibi[:, :, :seqlen, :seqlen].to(hidden_states.dtype)
        attn_bias = extended_attention_mask + alibi_bias
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attn_bias)
        return hidden_states


def make_encoder():
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        num_hidden_layers=1,
        alibi_starting_size=16,
        layer_norm_eps=1e-12,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    return BertEncoder(config)


EXPECT = {
    "target": "make_encoder",
    "kind": "multihead",
    "ok": False,
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "layer": "layer.0.attention.self",
    "style": "MosaicBERT bert_layers.py (Wqkv rearranged 'b s (t h d)', k permuted to b h d s, encoder-held alibi rebuilt past alibi_starting_size, extended mask * -10000 + alibi, GLU MLP); slopes times +|j - i|",
}
