"""Baichuan-13B-style model body: W_pack, ALiBi built in key-position form (slope * j) plus a -inf future mask, 6 heads."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def _get_interleave(n):
    """ALiBi slopes for n heads; for a head count that is not a power of two, interleave from the next one up."""

    def _get_interleave_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return _get_interleave_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        _get_interleave_power_of_2(closest_power_of_2)
        + _get_interleave(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def _fill_with_neg_inf(t):
    return t.fill_(float("-inf"))


def _gen_alibi_mask(n_head, max_pos, dtype):
    slopes = torch.tensor(_get_interleave(n_head), dtype=dtype)
    # bias of key j is slope * j: the same for every query, so only its difference along a row matters
    alibi = slopes[:, None, None] * torch.arange(max_pos, dtype=dtype)[None, None, :].expand(
        n_head, -1, -1
    )
    alibi = alibi.view(n_head, 1, max_pos)
    alibi_mask = torch.triu(_fill_with_neg_inf(torch.zeros(max_pos, max_pos, dtype=dtype)), 1)
    return alibi_mask.unsqueeze(0) + alibi  # (n_head, max_pos, max_pos)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, epsilon=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size).fill_(1.0))
        self.epsilon = epsilon

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.epsilon)


class BaichuanAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        proj = self.W_pack(hidden_states)
        proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        query_states = self._shape(proj[0], q_len, bsz)
        key_states = self._shape(proj[1], q_len, bsz)
        value_states = self._shape(proj[2], q_len, bsz)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            if q_len == 1:
                attention_mask = attention_mask[:, -1:, :]
            else:
                attention_mask = attention_mask[:, :q_len, :q_len]
            attn_weights = attn_weights + attention_mask
            attn_weights = torch.max(
                attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min)
            )
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), attn_weights


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BaichuanLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = BaichuanAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class BaichuanModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.num_attention_heads
        self.max_cache_pos = config.model_max_length
        self.layers = nn.ModuleList(
            [BaichuanLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.first_run = True
        self.future_mask = None

    def get_alibi_mask(self, tensor, seq_length_with_past):
        if (
            self.first_run
            or seq_length_with_past > self.max_cache_pos
            or self.future_mask.dtype != tensor.dtype
        ):
            self.first_run = False
            self.max_cache_pos = max(seq_length_with_past, self.max_cache_pos)
            self.future_mask = _gen_alibi_mask(self.n_head, self.max_cache_pos, tensor.dtype).to(
                tensor.device
            )
        return self.future_mask[: self.n_head, :seq_length_with_past, :seq_length_with_past]

    def forward(self, inputs_embeds):
        seq_length = inputs_embeds.shape[1]
        alibi_mask = self.get_alibi_mask(inputs_embeds, seq_length)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=alibi_mask)
        return self.norm(hidden_states)


def make_baichuan():
    config = SimpleNamespace(
        hidden_size=48,
        num_attention_heads=6,
        intermediate_size=96,
        num_hidden_layers=1,
        model_max_length=64,
        rms_norm_eps=1e-6,
    )
    return BaichuanModel(config)


EXPECT = {
    "target": "make_baichuan",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 6,
        "kv_heads": 6,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "alibi",
    },
    "style": "Baichuan-13B remote code (W_pack unflatten/transpose split, _get_interleave slopes for 6 heads, _gen_alibi_mask = triu(-inf) + slope * key position, torch.max with finfo.min)",
}
