"""Cerebras BTLM-style GPT-2 body (Conv1D c_attn, ALiBi -slope * |i - j| from the model, 6 heads); bug: the slope
helper only has the power-of-two formula, so 6 heads get 2**(-8/6 * k) instead of the interleaved standard set."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class Conv1D(nn.Module):
    """GPT-2's transposed linear: weight is (in_features, out_features)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02 * 10)
        nn.init.normal_(self.bias, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def _get_alibi_slopes(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    ratio = start
    return [start * ratio**i for i in range(n)]


class AlibiPositionEmbeddingLayer(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.register_buffer(
            "slopes", torch.tensor(_get_alibi_slopes(num_heads)).unsqueeze(-1), persistent=False
        )

    def forward(self, seq_length, key_length, cached_qk_len=0):
        context_position = torch.arange(
            cached_qk_len, cached_qk_len + seq_length, device=self.slopes.device
        )[:, None]
        memory_position = torch.arange(key_length + cached_qk_len, device=self.slopes.device)[
            None, :
        ]
        relative_position = memory_position - context_position
        relative_position = torch.abs(relative_position).unsqueeze(0).expand(self.num_heads, -1, -1)
        return (self.slopes * -1.0).unsqueeze(1) * relative_position  # (heads, q, k)


class BTLMAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.scale_attn_weights = config.scale_attn_weights
        self.attn_scale_power = 1.0 if config.scale_qk_dot_by_d else 0.5
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (num_heads * attn_head_size,))

    def _attn(self, query, key, value, position_bias=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full(
                [],
                value.size(-1) ** self.attn_scale_power,
                dtype=attn_weights.dtype,
                device=attn_weights.device,
            )
        if position_bias is not None:
            attn_weights = attn_weights + position_bias.unsqueeze(0)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = self.attn_dropout(attn_weights)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, position_bias=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output, attn_weights = self._attn(query, key, value, position_bias=position_bias)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.resid_dropout(self.c_proj(attn_output))
        return attn_output, attn_weights


class BTLMMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.hidden_size)
        self.c_fc2 = Conv1D(intermediate_size, config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, intermediate_size)

    def forward(self, hidden_states):
        return self.c_proj(self.c_fc(hidden_states) * nn.functional.silu(self.c_fc2(hidden_states)))


class BTLMBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = BTLMAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = BTLMMLP(4 * config.hidden_size, config)

    def forward(self, hidden_states, position_bias=None):
        attn_output, _ = self.attn(self.ln_1(hidden_states), position_bias=position_bias)
        hidden_states = attn_output + hidden_states
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class BTLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([BTLMBlock(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.relative_pe = AlibiPositionEmbeddingLayer(config.num_attention_heads)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_bias = self.relative_pe(seq_len, seq_len).to(inputs_embeds.dtype)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, position_bias=position_bias)
        return self.ln_f(hidden_states)


def make_btlm():
    config = SimpleNamespace(
        hidden_size=48,
        num_attention_heads=6,
        n_layer=1,
        max_position_embeddings=256,
        layer_norm_epsilon=1e-5,
        scale_attn_weights=True,
        scale_qk_dot_by_d=False,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
    )
    return BTLMModel(config)


EXPECT = {
    "target": "make_btlm",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "layer": "h.0.attn",
    "style": "Cerebras BTLM (GPT-2 layout Conv1D c_attn/c_proj, SwiGLU MLP, AlibiPositionEmbeddingLayer -slope*|j-i| passed as position_bias, bool tril buffer); power-of-two-only slope helper used for 6 heads",
}
