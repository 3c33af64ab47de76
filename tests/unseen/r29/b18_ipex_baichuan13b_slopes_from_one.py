"""ipex-llm (intel-analytics `ipex_llm/transformers/models/baichuan.py`) Baichuan2-13B attention
(`baichuan_attention_forward_13b`, CPU branch): fused `W_pack` split in three, view/transpose,
matmul / sqrt(head_dim), the model's `future_mask` from `_gen_alibi_mask` (`_get_interleave` slopes,
key-position ALiBi plus -inf future) added and clamped by torch.max(finfo.min), softmax, `o_proj`.

This file: _get_interleave_power_of_2 returns ratio**i: slopes 1, r, r^2, ... instead of r, r^2, ...."""

import math
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F


class BaichuanConfig:
    hidden_size = 64
    intermediate_size = 160
    num_attention_heads = 8
    num_hidden_layers = 1
    model_max_length = 128
    rms_norm_eps = 1e-6


def invalidInputError(condition, errMsg):
    if not condition:
        raise RuntimeError(errMsg)


def _get_interleave(n):
    def _get_interleave_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return _get_interleave_power_of_2(n)
    else:
        closest_power_of_2 = 2 ** math.floor(math.log2(n))
        return (
            _get_interleave_power_of_2(closest_power_of_2)
            + _get_interleave(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
        )


def _fill_with_neg_inf(t):
    return t.fill_(float("-inf"))


def _gen_alibi_mask(n_head, max_pos):
    """Baichuan2-13B: alibi in key-position form plus the -inf future mask, [n_head, max_pos, max_pos]."""
    slopes = torch.tensor(_get_interleave(n_head), dtype=torch.float64)
    position_point = torch.arange(max_pos, dtype=torch.float64) - max_pos + 1
    position_point = position_point.unsqueeze(0).unsqueeze(0).expand(n_head, -1, -1)
    diag = torch.diag(position_point[0])
    position_point = position_point - diag.unsqueeze(0).unsqueeze(0).transpose(-1, -2)
    alibi = slopes.unsqueeze(1).unsqueeze(1) * position_point
    alibi = alibi.view(n_head, 1, max_pos)
    alibi_mask = torch.triu(_fill_with_neg_inf(torch.zeros([max_pos, max_pos], dtype=torch.float64)), 1)
    alibi_mask = alibi_mask.unsqueeze(0) + alibi
    return alibi_mask


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, epsilon=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.epsilon = epsilon

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.epsilon)
        return self.weight * hidden_states


class BaichuanAttention(nn.Module):
    def __init__(self, config: BaichuanConfig):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.max_position_embeddings = config.model_max_length
        invalidInputError(self.head_dim * self.num_heads == self.hidden_size,
                          "hidden_size must be divisible by num_heads")
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        """ipex_llm baichuan_attention_forward_13b, CPU branch."""
        bsz, q_len, _ = hidden_states.size()

        proj = self.W_pack(hidden_states)
        query_states, key_states, value_states = proj.split([self.hidden_size] * 3, dim=-1)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = key_states.shape[-2]

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        if attention_mask is not None:
            if q_len == 1:  # inference with cache
                if len(attention_mask.size()) == 4:
                    attention_mask = attention_mask[:, :, -1:, :]
                else:
                    attention_mask = attention_mask[:, -1:, :]
            attn_weights = attn_weights + attention_mask
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights.to(value_states.dtype), value_states)

        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BaichuanLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = BaichuanAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = residual + self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class BaichuanModel(nn.Module):
    """Baichuan2-13B body (ALiBi) as patched by ipex-llm (baichuan_13b_get_alibi_mask), fed with embeddings."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_head = config.num_attention_heads
        self.layers = nn.ModuleList([BaichuanLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.max_cache_pos = config.model_max_length
        self.register_buffer("future_mask", _gen_alibi_mask(self.n_head, self.max_cache_pos), persistent=False)

    def get_alibi_mask(self, tensor, seq_length_with_past):
        mask = self.future_mask[: self.n_head, :seq_length_with_past, :seq_length_with_past]
        return mask.to(tensor.dtype)

    def forward(self, inputs_embeds):
        seq_length = inputs_embeds.shape[1]
        alibi_mask = self.get_alibi_mask(inputs_embeds, seq_length)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=alibi_mask)
        return self.norm(hidden_states)


def make_ipex_baichuan13b():
    torch.manual_seed(2946)
    model = BaichuanModel(BaichuanConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_ipex_baichuan13b',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'biased_scores',
 'mistake': 'bias_slopes',
 'style': 'ipex-llm Baichuan2-13B attention (models/baichuan.py): _get_interleave_power_of_2 '
          'returns ratio**i: slopes 1, r, r^2, ... instead of r, r^2, ...'}
