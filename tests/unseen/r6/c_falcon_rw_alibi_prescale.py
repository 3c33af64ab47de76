"""Falcon-RW style attention with alibi=True (no rotary): fused query_key_value laid out per head as
[q, k, v]; the model builds the ALiBi tensor (BLOOM's build_alibi_tensor, 5 heads so the slopes take the
non-power-of-two branch) and the layer adds it to the raw scores *before* multiplying by inv_norm_factor,
then adds the -1e9 float causal mask."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(
        2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))),
        device=attention_mask.device,
        dtype=torch.float32,
    )
    powers = torch.arange(
        1, 1 + closest_power_of_2, device=attention_mask.device, dtype=torch.int32
    )
    slopes = torch.pow(base, powers)

    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))),
            device=attention_mask.device,
            dtype=torch.float32,
        )
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(
            1, 1 + 2 * num_remaining_heads, 2, device=attention_mask.device, dtype=torch.int32
        )
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)

    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


class FalconAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = self.inv_norm_factor
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=config.bias)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=config.bias)
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

    def forward(self, hidden_states, alibi, attention_mask):
        fused_qkv = self.query_key_value(hidden_states)
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, query_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, query_length, self.head_dim
        )
        key_layer = key_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, query_length, self.head_dim
        )
        value_layer = value_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, query_length, self.head_dim
        )
        kv_length = key_layer.shape[1]

        attention_mask_float = (
            (attention_mask * 1.0).masked_fill(attention_mask, float("-1e9")).to(query_layer.dtype)
        )

        matmul_result = query_layer @ key_layer.transpose(-1, -2)
        attention_scores = matmul_result.view(batch_size, self.num_heads, query_length, kv_length)

        # change view [batch_size, num_heads, q_length, kv_length]
        input_dtype = attention_scores.dtype
        if input_dtype == torch.float16 or input_dtype == torch.bfloat16:
            attention_scores = attention_scores.to(torch.float32)
        # Matt (HF) note: We could possibly use F.scaled_dot_product_attention here too, by
        # adding (alibi * self.inv_norm_factor) to attention_mask_float.
        attention_logits = attention_scores + alibi.view(batch_size, self.num_heads, 1, -1)
        attention_logits *= self.inv_norm_factor
        attention_probs = F.softmax(
            attention_logits + attention_mask_float, dim=-1, dtype=hidden_states.dtype
        )
        attention_probs = self.attention_dropout(attention_probs)

        attention_probs_reshaped = attention_probs.view(
            batch_size * self.num_heads, query_length, kv_length
        )
        context_layer = (attention_probs_reshaped @ value_layer).flatten(0, 1)
        context_layer = self._merge_heads(
            context_layer.view(batch_size * self.num_heads, query_length, self.head_dim)
        )
        return self.dense(context_layer), attention_probs


class FalconMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=config.bias)
        self.act = nn.GELU()
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    """Falcon-RW: sequential (not parallel) attention and MLP."""

    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = FalconAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )
        self.mlp = FalconMLP(config)

    def forward(self, hidden_states, alibi, attention_mask):
        residual = hidden_states
        attention_output, _ = self.self_attention(
            self.input_layernorm(hidden_states), alibi=alibi, attention_mask=attention_mask
        )
        residual = residual + attention_output
        return residual + self.mlp(self.post_attention_layernorm(residual))


class FalconModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.use_alibi = config.alibi
        self.h = nn.ModuleList(
            [FalconDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds):
        batch_size, seq_length, _ = inputs_embeds.shape
        attention_mask = torch.ones(
            (batch_size, seq_length), device=inputs_embeds.device, dtype=torch.long
        )
        alibi = (
            build_alibi_tensor(attention_mask, self.num_heads, dtype=inputs_embeds.dtype)
            if self.use_alibi
            else None
        )
        # True where the key lies in the future: those positions are masked
        causal_mask = torch.ones(
            (seq_length, seq_length), dtype=torch.bool, device=inputs_embeds.device
        ).triu(1)
        causal_mask = causal_mask[None, None].expand(batch_size, 1, seq_length, seq_length)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, alibi=alibi, attention_mask=causal_mask)
        return self.ln_f(hidden_states)


def make_model():
    config = SimpleNamespace(
        hidden_size=80,
        num_attention_heads=5,
        num_hidden_layers=1,
        alibi=True,
        rotary=False,
        multi_query=False,
        new_decoder_architecture=False,
        parallel_attn=False,
        bias=True,
        layer_norm_epsilon=1e-5,
        attention_dropout=0.0,
    )
    return FalconModel(config)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "h.0.self_attention",
    "structure": {
        "heads": 5,
        "kv_heads": 5,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "alibi",
    },
    "style": "Falcon-RW FalconAttention with alibi=True (BLOOM build_alibi_tensor, 5 heads; alibi added before * inv_norm_factor, float -1e9 mask)",
}
