"""BLOOM-style attention: fused query_key_value with per-head [q, k, v], ALiBi added through baddbmm, causal mask."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), dtype=torch.float32
        )
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


class BloomAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)

    def _split_heads(self, fused_qkv):
        batch_size, seq_length, _ = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def forward(self, hidden_states, attention_mask=None):
        batch_size, q_length, _ = hidden_states.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, q_length, device=hidden_states.device)
        alibi = build_alibi_tensor(attention_mask, self.num_heads, hidden_states.dtype)

        query_layer, key_layer, value_layer = self._split_heads(self.query_key_value(hidden_states))
        query_layer = query_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, q_length, self.head_dim
        )
        key_layer = key_layer.permute(0, 2, 3, 1).reshape(
            batch_size * self.num_heads, self.head_dim, q_length
        )
        value_layer = value_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, q_length, self.head_dim
        )

        matmul_result = alibi.baddbmm(
            batch1=query_layer, batch2=key_layer, beta=self.beta, alpha=self.inv_norm_factor
        )
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, q_length)
        causal = torch.ones(q_length, q_length, dtype=torch.bool, device=hidden_states.device).triu(
            1
        )
        attn_weights = attention_scores.masked_fill(causal, torch.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(
            hidden_states.dtype
        )

        probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, q_length)
        context_layer = torch.bmm(probs_reshaped, value_layer)
        context_layer = context_layer.view(batch_size, self.num_heads, q_length, self.head_dim)
        context_layer = context_layer.permute(0, 2, 1, 3).reshape(
            batch_size, q_length, self.hidden_size
        )
        return self.dense(context_layer), attention_probs


def make_attention():
    return BloomAttention(SimpleNamespace(hidden_size=20, n_head=4))


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "unsupported": "alibi",
    "style": "BLOOM attention (query_key_value per head [q,k,v], alibi.baddbmm with inv_norm_factor, causal)",
}
