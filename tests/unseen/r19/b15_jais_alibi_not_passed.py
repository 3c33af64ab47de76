"""core42 JAIS (`modeling_jais.py`, Hugging Face remote code) `JAISAttention` in plain torch: GPT-2
`Conv1D` `c_attn` (weight stored (in, out), `addmm`) split into q/k/v, `_split_heads` permute,
`_attn` with muP-aware scaling `value.size(-1) ** attn_scale_power` (0.5 here: `scale_qk_dot_by_d=False`),
ALiBi from the model's `AlibiPositionEmbeddingLayer` (slopes from `_get_alibi_slopes`, bias
`-slope * |key - query|`) added to the scaled scores, the `bias` tril buffer with
`torch.where(causal_mask, w, finfo.min)`, `_merge_heads` and `c_proj`. The model body holds the
ALiBi layer (`relative_pe`) and passes `position_bias` to the block's attention.

This file: one bug: the model compares position_embedding_type with "ALiBi" while the config says "alibi", so position_bias stays None and no bias is added."""

import math

import torch
from torch import nn


class JAISConfig:
    n_embd = 48
    n_head = 6
    n_positions = 64
    position_embedding_type = "alibi"
    scale_qk_dot_by_d = False


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.15)
        nn.init.normal_(self.bias, std=0.05)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class AlibiPositionEmbeddingLayer(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads
        slopes = torch.tensor(AlibiPositionEmbeddingLayer._get_alibi_slopes(num_heads), dtype=torch.float64)
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, seq_length, key_length, cached_qk_len=0):
        context_position = torch.arange(cached_qk_len, cached_qk_len + seq_length)[:, None]
        memory_position = torch.arange(key_length + cached_qk_len)[None, :]
        relative_position = memory_position - context_position
        relative_position = torch.abs(relative_position).unsqueeze(0).expand(self.num_heads, -1, -1)
        alibi = (self.slopes * -1.0).unsqueeze(1).unsqueeze(1) * relative_position
        return alibi

    @staticmethod
    def _get_alibi_slopes(n):
        def get_slopes_power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            ratio = start
            return [start * ratio**i for i in range(n)]

        if math.log2(n).is_integer():
            return get_slopes_power_of_2(n)
        closest_power_of_2 = 2 ** math.floor(math.log2(n))
        return (
            get_slopes_power_of_2(closest_power_of_2)
            + AlibiPositionEmbeddingLayer._get_alibi_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
        )


class JAISAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.scale_attn_weights = True
        self.attn_scale_power = 1.0 if config.scale_qk_dot_by_d else 0.5
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value, position_bias=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full(
                [], value.size(-1) ** self.attn_scale_power, dtype=attn_weights.dtype
            )
        if position_bias is not None:
            attn_weights = attn_weights + position_bias.type_as(attn_weights).unsqueeze(0)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (num_heads * attn_head_size,))

    def forward(self, hidden_states, layer_past=None, position_bias=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        present = (key, value)
        attn_output, _ = self._attn(query, key, value, position_bias=position_bias)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.c_proj(attn_output)
        return attn_output, present


class JAISModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([JAISAttention(config)])
        self.relative_pe = (
            AlibiPositionEmbeddingLayer(config.n_head) if config.position_embedding_type == "alibi" else None
        )

    def forward(self, inputs_embeds):
        _, seq_len, _ = inputs_embeds.shape
        position_bias = None
        if self.relative_pe is not None and self.config.position_embedding_type == "ALiBi":
            position_bias = self.relative_pe(seq_len, seq_len)
        outputs = self.h[0](inputs_embeds, position_bias=position_bias)
        return outputs[0]


def make_jais():
    torch.manual_seed(1954)
    return JAISModel(JAISConfig()).eval()


EXPECT = {'target': 'make_jais',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'h.0',
 'stage': 'biased_scores',
 'mistake': 'bias_missing',
 'style': 'core42 JAIS JAISAttention (ALiBi): position_embedding_type compared to "ALiBi" (config '
          'says "alibi"): no bias reaches _attn'}
