"""A tiny Baichuan-13B in the style of its modeling_baichuan.py (ALiBi, W_pack, legacy tuple cache).

BaichuanForCausalLM -> model (embed_tokens, layers ModuleList, norm, future_mask) + lm_head.
W_pack fuses q|k|v (no bias), split with unflatten(-1, (3, hidden)); 8 heads of 8; one model-level
ALiBi+causal future_mask (slopes 2^-1 .. 2^-8, bias by key position, -inf above the diagonal)
sliced to the length with past; the eager attention adds it after the 1/sqrt(d) scale.
(config.xformers_layers is empty here: every layer is eager.)

Cache (hf): past_key_values is a tuple of per-layer (k, v), (bsz, heads, len, head_dim).
model(ids, use_cache=True) -> .past_key_values; model(tok, past_key_values=..., use_cache=True).

Slip (decoding only): on a one-token step the attention takes row 0 of the mask,
attention_mask[:, :1, :], instead of the last row.  Row 0 is the first token's row: every key but
key 0 is -inf, so the decoded token sees only the first cached token (and the bias of the wrong
row).  Full forward and prompt pass are exact; step 0, model.layers.0.self_attn: cache_mask.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "Baichuan-13B modeling_baichuan.py: W_pack unflatten, _gen_alibi_mask future_mask, tuple cache; "
    "slip: one-token steps slice mask row 0 instead of the last row",
}


@dataclass
class BaichuanConfig:
    vocab_size: int = 176
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 8
    model_max_length: int = 64
    rms_norm_eps: float = 1e-6
    xformers_layers: tuple = ()


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Tuple] = None


def _get_interleave(n):
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
    return t.float().fill_(float("-inf")).type_as(t)


def _gen_alibi_mask(n_head, max_pos):
    slopes = torch.Tensor(_get_interleave(n_head))
    alibi = slopes.unsqueeze(1).unsqueeze(1) * torch.arange(max_pos).unsqueeze(0).unsqueeze(
        0
    ).expand(n_head, -1, -1)
    alibi = alibi.view(n_head, 1, max_pos)
    alibi_mask = torch.triu(_fill_with_neg_inf(torch.zeros([max_pos, max_pos])), 1)
    return alibi_mask.unsqueeze(0) + alibi


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, epsilon=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.epsilon = epsilon

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.epsilon))


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BaichuanAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        # the memory-efficient path builds its own ALiBi bias per call
        self.use_xformers = layer_idx in config.xformers_layers
        self.register_buffer(
            "slopes", torch.tensor(_get_interleave(self.num_heads)), persistent=False
        )

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        proj = self.W_pack(hidden_states)
        proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        query_states = proj[0].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = proj[1].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = proj[2].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None
        kv_seq_len = key_states.shape[-2]

        if self.use_xformers:
            q_pos = torch.arange(kv_seq_len - q_len, kv_seq_len, device=hidden_states.device)
            k_pos = torch.arange(kv_seq_len, device=hidden_states.device)
            rel = q_pos[:, None] - k_pos[None, :]
            attn_bias = self.slopes.to(query_states.dtype)[:, None, None] * rel.to(
                query_states.dtype
            )
            attn_bias = attn_bias.masked_fill(rel < 0, float("-inf")).unsqueeze(0)
            attn_output = F.scaled_dot_product_attention(
                query_states, key_states, value_states, attn_mask=attn_bias
            )
        else:
            attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
                self.head_dim
            )
            if attention_mask is not None:
                if q_len == 1:  # inference with cache
                    attention_mask = attention_mask[:, :1, :]  # SLIP
                else:
                    attention_mask = attention_mask[:, -q_len:, -kv_seq_len:]
                attn_weights = attn_weights + attention_mask.unsqueeze(0)
                attn_weights = torch.max(
                    attn_weights,
                    torch.tensor(torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype),
                )
            attn_weights = torch.softmax(attn_weights, dim=-1)
            attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


class BaichuanLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = BaichuanAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states, present = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, past_key_value, use_cache
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class BaichuanModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_head = config.num_attention_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [BaichuanLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer(
            "future_mask", _gen_alibi_mask(self.n_head, config.model_max_length), persistent=False
        )

    def get_alibi_mask(self, tensor, seq_length_with_past):
        return self.future_mask[: self.n_head, :seq_length_with_past, :seq_length_with_past].to(
            tensor.dtype
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        seq_length = input_ids.shape[1]
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        hidden_states = self.embed_tokens(input_ids)
        alibi_mask = self.get_alibi_mask(hidden_states, past_len + seq_length)
        next_cache = () if use_cache else None
        for idx, layer in enumerate(self.layers):
            pkv = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, alibi_mask, pkv, use_cache)
            if use_cache:
                next_cache += (present,)
        return self.norm(hidden_states), next_cache


class BaichuanForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = BaichuanModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, next_cache = self.model(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        return CausalLMOutputWithPast(
            logits=self.lm_head(hidden_states), past_key_values=next_cache
        )


def make_model():
    torch.manual_seed(6)
    model = BaichuanForCausalLM(BaichuanConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
    return model.eval()
