"""A torch port of PaddleNLP's BLOOM (`paddlenlp/transformers/bloom/modeling.py`), kept close to
Paddle's conventions: Paddle Linears with (in, out) weights; one `query_key_value` projection split per
head as [q|k|v] (`_split_heads`: reshape to [bs, seq, heads, 3, head_dim]); `build_alibi_tensor`
in the model (closest power of two, `base = 2 ** (-(2 ** -(log2(closest) - 3)))`, slopes times
`(cumsum(mask) - 1) * mask`, reshaped to [bs * heads, 1, seq]); the layer adds it through
`baddbmm(alibi, q, k, beta=1.0, alpha=1 / sqrt(head_dim))` on (bs * heads) folds; a bool causal mask
filled with finfo.min; softmax; bmm with the values; `_merge_heads`; `dense`. An SDPA fast path
(`use_flash_attention`) exists as in later PaddleNLP versions. Norms and MLPs are left out.

This file: one bug: the alibi tensor is built as `-slopes * arange`, so later keys (the nearer ones for a causal query) get the larger penalty: the bias favours distant tokens"""

import math
import torch
import torch.nn.functional as F
from torch import nn


class BloomConfig:
    hidden_size = 64
    n_head = 4
    use_flash_attention = False


class PaddleLinear(nn.Module):
    def __init__(self, in_features, out_features, bias_attr=True):
        super().__init__()
        bound = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_features).uniform_(-bound, bound)) if bias_attr else None

    def forward(self, x):
        y = torch.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float64)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.float64)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), dtype=torch.float64)
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, dtype=torch.float64)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    mask = attention_mask.to(torch.float64)
    arange_tensor = ((mask.cumsum(-1) - 1) * mask)[:, None, :]
    alibi = -slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


class BloomAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = PaddleLinear(self.hidden_size, 3 * self.hidden_size, bias_attr=True)
        self.dense = PaddleLinear(self.hidden_size, self.hidden_size, bias_attr=True)

    def _split_heads(self, fused_qkv):
        batch_size, seq_length, _ = fused_qkv.shape
        fused_qkv = fused_qkv.reshape(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _merge_heads(self, x):
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.reshape(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, alibi, attention_mask):
        fused_qkv = self.query_key_value(hidden_states)
        query_layer, key_layer, value_layer = self._split_heads(fused_qkv)
        batch_size, q_length, _, _ = query_layer.shape
        if self.config.use_flash_attention:
            # [bs, seq, heads, dim] -> [bs, heads, seq, dim]; the additive mask goes in as attn_mask
            attn_mask = torch.zeros(attention_mask.shape, dtype=query_layer.dtype).masked_fill(
                attention_mask, torch.finfo(query_layer.dtype).min
            )
            context = F.scaled_dot_product_attention(
                query_layer.transpose(1, 2), key_layer.transpose(1, 2), value_layer.transpose(1, 2),
                attn_mask=attn_mask,
            )
            context = context.transpose(1, 2).reshape(batch_size, q_length, self.hidden_size)
            return self.dense(context)
        query_layer = query_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        key_layer = key_layer.permute(0, 2, 3, 1).reshape(batch_size * self.num_heads, self.head_dim, q_length)
        value_layer = value_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        kv_length = key_layer.shape[-1]
        matmul_result = torch.baddbmm(
            alibi, query_layer, key_layer, beta=self.beta, alpha=self.inv_norm_factor
        )
        attention_scores = matmul_result.reshape(batch_size, self.num_heads, q_length, kv_length)
        attn_weights = attention_scores.masked_fill(attention_mask, torch.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, dim=-1)
        attention_probs_reshaped = attention_probs.reshape(batch_size * self.num_heads, q_length, kv_length)
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = self._merge_heads(context_layer)
        return self.dense(context_layer)


class BloomBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attention = BloomAttention(config)

    def forward(self, hidden_states, alibi, attention_mask):
        return hidden_states + self.self_attention(hidden_states, alibi, attention_mask)


class BloomModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([BloomBlock(config)])

    def forward(self, inputs_embeds):
        batch_size, seq_length, _ = inputs_embeds.shape
        attention_mask = torch.ones((batch_size, seq_length), dtype=torch.bool)
        alibi = build_alibi_tensor(attention_mask, self.config.n_head, inputs_embeds.dtype)
        # True = masked (future key)
        causal_mask = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
        causal_mask = causal_mask[None, None].expand(batch_size, 1, seq_length, seq_length)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, alibi, causal_mask)
        return hidden_states


def make_paddle_bloom():
    torch.manual_seed(1763)
    return BloomModel(BloomConfig()).eval()


EXPECT = {'target': 'make_paddle_bloom',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'h.0.self_attention',
 'stage': 'biased_scores',
 'mistake': 'bias_sign',
 'style': 'PaddleNLP port: one bug: the alibi tensor is built as `-slopes * arange`, so later keys '
          '(the nearer ones for a causal query) get the larger penalty: the bias favours distant '
          'tokens'}
