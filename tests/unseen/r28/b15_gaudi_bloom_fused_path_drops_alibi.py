"""Hugging Face optimum-habana BLOOM (optimum/habana/transformers/models/bloom/modeling_bloom.py:
`gaudi_bloom_attention_forward`, `gaudi_bloom_build_alibi_tensor`, GaudiBloomModel): BLOOM's fused
`query_key_value` laid out (heads, 3, head_dim) and cut by `_split_heads`, queries/values reshaped to
(batch * heads, tokens, head_dim) and keys to (batch * heads, head_dim, tokens), ALiBi built once per
model from the attention mask in key-position form (slope * j, Press's slopes with the interleave for
head counts that are not powers of two), scores by `alibi.baddbmm(query, key, beta=self.beta,
alpha=self.inv_norm_factor)`, the boolean causal mask applied by `masked_fill` with the dtype minimum,
softmax, `torch.bmm` with the values, `_merge_heads`, `dense`. Gaudi's static-shape `token_idx` argument is
kept (unused without a cache); the dropout-add residual sits in the block.

This file: one bug: use_flash_attention path (FusedSDPA emulation) computes bmm(q, k) * inv_norm_factor and never adds the alibi tensor."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class BloomConfig:
    hidden_size = 64
    n_head = 4
    n_layer = 1
    layer_norm_epsilon = 1e-5
    hidden_dropout = 0.0
    attention_dropout = 0.0
    use_flash_attention = True


def gaudi_bloom_build_alibi_tensor(attention_mask, num_heads, dtype, training=False):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(
        2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float64
    )
    powers = torch.arange(1, 1 + closest_power_of_2, device=attention_mask.device, dtype=torch.int32)
    slopes = torch.pow(base, powers)

    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float64
        )
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, device=attention_mask.device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)

    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


class GaudiBloomAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.split_size = self.hidden_size
        self.use_flash_attention = config.use_flash_attention
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def _split_heads(self, fused_qkv):
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _merge_heads(self, x):
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, alibi, attention_mask, token_idx=None):
        fused_qkv = self.query_key_value(hidden_states)
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, q_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        key_layer = key_layer.permute(0, 2, 3, 1).reshape(batch_size * self.num_heads, self.head_dim, q_length)
        value_layer = value_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        kv_length = key_layer.shape[-1]

        if self.use_flash_attention:
            # FusedSDPA takes the causal mask only; alibi is not forwarded
            matmul_result = torch.bmm(query_layer, key_layer) * self.inv_norm_factor
        else:
            matmul_result = alibi.baddbmm(batch1=query_layer, batch2=key_layer, beta=self.beta, alpha=self.inv_norm_factor)
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, kv_length)

        input_dtype = attention_scores.dtype
        attn_weights = torch.masked_fill(attention_scores, attention_mask, torch.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, dim=-1)
        attention_probs = self.attention_dropout(attention_probs).to(input_dtype)
        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, kv_length)
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)

        context_layer = self._merge_heads(context_layer)
        return self.dense(context_layer)


class BloomMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.gelu_impl = nn.GELU(approximate="tanh")
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(self.gelu_impl(self.dense_h_to_4h(hidden_states)))


def dropout_add(x, residual, prob, training):
    return residual + F.dropout(x, p=prob, training=training)


class GaudiBloomBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = GaudiBloomAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = BloomMLP(config)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, hidden_states, alibi, attention_mask, token_idx=None):
        layernorm_output = self.input_layernorm(hidden_states)
        residual = hidden_states
        attention_output = self.self_attention(layernorm_output, alibi, attention_mask, token_idx=token_idx)
        attention_output = dropout_add(attention_output, residual, self.hidden_dropout, self.training)
        layernorm_output = self.post_attention_layernorm(attention_output)
        return attention_output + self.mlp(layernorm_output)


class GaudiBloomModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.n_head
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.h = nn.ModuleList([GaudiBloomBlock(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds, token_idx=None):
        batch_size, seq_length, _ = inputs_embeds.shape
        hidden_states = self.word_embeddings_layernorm(inputs_embeds)
        attention_mask = torch.ones((batch_size, seq_length), device=hidden_states.device)
        alibi = gaudi_bloom_build_alibi_tensor(attention_mask, self.num_heads, hidden_states.dtype, self.training)
        causal_mask = torch.triu(
            torch.ones((seq_length, seq_length), dtype=torch.bool, device=hidden_states.device), diagonal=1
        )[None, None, :, :].expand(batch_size, 1, seq_length, seq_length)
        for block in self.h:
            hidden_states = block(hidden_states, alibi, causal_mask, token_idx=token_idx)
        return self.ln_f(hidden_states)


def make_gaudi_bloom():
    torch.manual_seed(3658)
    model = GaudiBloomModel(BloomConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_gaudi_bloom",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "h.0.self_attention",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "optimum-habana GaudiBloom attention: fused-SDPA branch without alibi"
}
