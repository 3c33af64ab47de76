"""BLOOM attention (Hugging Face): fused query_key_value with per-head [q, k, v], the model's ALiBi tensor
(6 heads: 4 power-of-two slopes plus 2 interleaved extra slopes) folded in with
alibi.baddbmm(q, k^T, beta=1, alpha=inv_norm_factor), causal mask filled with finfo.min, dense output."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def build_alibi_tensor(attention_mask, num_heads, dtype):
    """Link to paper: https://arxiv.org/abs/2108.12409.  The tensor is not causal: softmax is invariant to a
    per-row constant, so slope * key_position gives the same weights as slope * (key - query)."""
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


class BloomAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.split_size = self.hidden_size
        self.hidden_dropout = config.hidden_dropout
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.layer_idx = layer_idx
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def _reshape(self, fused_qkv):
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        query_layer = fused_qkv[..., 0, :].transpose(1, 2)
        key_layer = fused_qkv[..., 1, :].transpose(1, 2)
        value_layer = fused_qkv[..., 2, :].transpose(1, 2)
        return query_layer, key_layer, value_layer

    def _merge_heads(self, x):
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, alibi, attention_mask):
        batch_size, q_length, _ = hidden_states.shape
        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]
        query_layer, key_layer, value_layer = self._reshape(fused_qkv)

        # reshape qkv for further computations
        query_layer = query_layer.reshape(batch_size * self.num_heads, -1, self.head_dim)
        key_layer = key_layer.reshape(batch_size * self.num_heads, -1, self.head_dim).transpose(
            -1, -2
        )
        value_layer = value_layer.reshape(batch_size * self.num_heads, -1, self.head_dim)

        # [batch_size * num_heads, q_length, kv_length]
        attention_scores = alibi.baddbmm(
            batch1=query_layer,
            batch2=key_layer,
            beta=self.beta,
            alpha=self.inv_norm_factor,
        )

        # change view to [batch_size, num_heads, q_length, kv_length]
        attn_weights = attention_scores.view(batch_size, self.num_heads, q_length, -1)
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : key_layer.shape[-1]]
            attn_weights = attn_weights + causal_mask

        # cast attention scores to fp32, compute scaled softmax and cast back to initial dtype
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(value_layer.dtype)
        attention_probs = self.attention_dropout(attention_probs)

        # change view [batch_size x num_heads, q_length, kv_length]
        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, -1)

        # matmul: [batch_size * num_heads, q_length, head_dim]
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = self._merge_heads(context_layer)
        output_tensor = self.dense(context_layer)
        output_tensor = F.dropout(output_tensor, p=self.hidden_dropout, training=self.training)
        return output_tensor, attention_probs


class BloomMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.gelu_impl = nn.GELU(approximate="tanh")
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, residual):
        return residual + self.dense_4h_to_h(self.gelu_impl(self.dense_h_to_4h(hidden_states)))


class BloomBlock(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.num_heads = config.n_head
        self.self_attention = BloomAttention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )
        self.mlp = BloomMLP(config)

    def forward(self, hidden_states, alibi, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        residual = hidden_states
        attention_output, _ = self.self_attention(
            layernorm_output, alibi=alibi, attention_mask=attention_mask
        )
        attention_output = (
            residual + attention_output
        )  # BLOOM passes the residual into the attention; added here
        layernorm_output = self.post_attention_layernorm(attention_output)
        return self.mlp(layernorm_output, attention_output)


class BloomModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.n_head
        self.word_embeddings_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )
        self.h = nn.ModuleList([BloomBlock(config, layer_idx=i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds):
        batch_size, seq_length, _ = inputs_embeds.shape
        hidden_states = self.word_embeddings_layernorm(inputs_embeds)
        attention_mask = torch.ones((batch_size, seq_length), device=hidden_states.device)
        alibi = build_alibi_tensor(attention_mask, self.num_heads, dtype=hidden_states.dtype)

        min_dtype = torch.finfo(hidden_states.dtype).min
        causal_mask = torch.full(
            (seq_length, seq_length),
            min_dtype,
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None].expand(batch_size, 1, -1, -1)

        for block in self.h:
            hidden_states = block(hidden_states, alibi=alibi, attention_mask=causal_mask)
        return self.ln_f(hidden_states)


def make_model():
    config = SimpleNamespace(
        hidden_size=48,
        n_head=6,
        n_layer=1,
        layer_norm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return BloomModel(config)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "h.0.self_attention",
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
    "style": "BLOOM BloomModel/BloomAttention (per-head [q,k,v] query_key_value, build_alibi_tensor with 6 heads, alibi.baddbmm alpha=inv_norm_factor; the residual add moved from the attention to the block)",
}
