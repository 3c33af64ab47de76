"""A tiny BLOOM in the style of Hugging Face's modeling_bloom.py.

BloomForCausalLM -> transformer (word_embeddings, word_embeddings_layernorm, h ModuleList of
BloomBlock, ln_f) + tied lm_head.  ALiBi with 6 heads (not a power of two): build_alibi_tensor
takes the 4 slopes of the closest power of two and two extra slopes from the 8-head sequence
(2^-2, 2^-4, 2^-6, 2^-8, 2^-1, 2^-3), and biases by key position (cumsum of the attention
mask), which differs from -slope*(i-j) by a constant per row.  Fused query_key_value laid out
per head as (n_head, 3, head_dim); scores made with baddbmm(alibi, q, k, beta=1,
alpha=1/sqrt(head_dim)), so the bias is added after the scale.  Boolean causal mask filled
with finfo.min.  Legacy tuple cache: key cached as (batch*heads, head_dim, seq), value as
(batch*heads, seq, head_dim).  Correct.

Difference from the original: BLOOM adds the residual inside BloomAttention (dropout_add);
here the block adds it, so the attention module's output is the projected context only.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "transformer.h.0.self_attention",
        "transformer.h.1.self_attention",
        "transformer.h.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
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
    "style": "transformers modeling_bloom.py: build_alibi_tensor (non-power-of-2 heads), fused qkv "
    "(n_head, 3, head_dim), baddbmm(beta=1, alpha=inv_norm_factor), legacy (bh, d, s)/(bh, s, d) tuple cache",
}


@dataclass
class BloomConfig:
    vocab_size: int = 128
    hidden_size: int = 48
    n_layer: int = 3
    n_head: int = 6
    layer_norm_epsilon: float = 1e-5


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Tuple] = None


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


def bloom_gelu_forward(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomGelu(nn.Module):
    def forward(self, x):
        return bloom_gelu_forward(x)


class BloomAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.split_size = self.hidden_size
        self.layer_idx = layer_idx
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.attention_dropout = nn.Dropout(0.0)

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

    def forward(self, hidden_states, alibi, attention_mask, layer_past=None, use_cache=False):
        batch_size, q_length, _ = hidden_states.shape
        fused_qkv = self.query_key_value(hidden_states)
        query_layer, key_layer, value_layer = self._reshape(fused_qkv)

        query_layer = query_layer.reshape(batch_size * self.num_heads, -1, self.head_dim)
        key_layer = key_layer.reshape(batch_size * self.num_heads, -1, self.head_dim).transpose(
            -1, -2
        )
        value_layer = value_layer.reshape(batch_size * self.num_heads, -1, self.head_dim)

        if layer_past is not None:
            past_key, past_value = layer_past
            key_layer = torch.cat((past_key, key_layer), dim=2)
            value_layer = torch.cat((past_value, value_layer), dim=1)
        present = (key_layer, value_layer) if use_cache else None

        kv_length = key_layer.shape[-1]
        matmul_result = alibi.baddbmm(
            batch1=query_layer, batch2=key_layer, beta=self.beta, alpha=self.inv_norm_factor
        )
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, kv_length)
        input_dtype = attention_scores.dtype
        if input_dtype == torch.float16:
            attention_scores = attention_scores.to(torch.float)
        attn_weights = torch.masked_fill(
            attention_scores, attention_mask, torch.finfo(attention_scores.dtype).min
        )
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(input_dtype)
        attention_probs = self.attention_dropout(attention_probs)
        attention_probs_reshaped = attention_probs.view(
            batch_size * self.num_heads, q_length, kv_length
        )
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = self._merge_heads(context_layer)
        output_tensor = self.dense(context_layer)
        return output_tensor, present


class BloomMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.gelu_impl = BloomGelu()
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(self.gelu_impl(self.dense_h_to_4h(hidden_states)))


class BloomBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = BloomAttention(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )
        self.mlp = BloomMLP(config)

    def forward(self, hidden_states, alibi, attention_mask, layer_past=None, use_cache=False):
        layernorm_output = self.input_layernorm(hidden_states)
        attn_output, present = self.self_attention(
            layernorm_output,
            alibi=alibi,
            attention_mask=attention_mask,
            layer_past=layer_past,
            use_cache=use_cache,
        )
        hidden_states = hidden_states + attn_output
        layernorm_output = self.post_attention_layernorm(hidden_states)
        hidden_states = hidden_states + self.mlp(layernorm_output)
        return hidden_states, present


def _prepare_causal_mask(attention_mask, q_length, past_length):
    """Boolean (batch, 1, q, kv): True where a key must be hidden."""
    kv_length = past_length + q_length
    q_pos = torch.arange(past_length, kv_length)[:, None]
    k_pos = torch.arange(kv_length)[None, :]
    causal = k_pos > q_pos
    padding = ~attention_mask.bool()[:, None, None, :]
    return causal[None, None] | padding


class BloomModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.n_head
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )
        self.h = nn.ModuleList([BloomBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.h))
            past_length = 0
        else:
            past_length = past_key_values[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, past_length + seq_length), dtype=torch.long)

        inputs_embeds = self.word_embeddings(input_ids)
        hidden_states = self.word_embeddings_layernorm(inputs_embeds)
        alibi = build_alibi_tensor(attention_mask, self.num_heads, dtype=hidden_states.dtype)
        causal_mask = _prepare_causal_mask(attention_mask, seq_length, past_length)

        presents = () if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(
                hidden_states,
                alibi=alibi,
                attention_mask=causal_mask,
                layer_past=layer_past,
                use_cache=use_cache,
            )
            if use_cache:
                presents = presents + (present,)
        return self.ln_f(hidden_states), presents


class BloomForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = BloomModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.word_embeddings.weight

    def forward(self, input_ids, past_key_values=None, attention_mask=None, use_cache=False):
        hidden_states, presents = self.transformer(
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            use_cache=use_cache,
        )
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states), past_key_values=presents)


def make_model():
    torch.manual_seed(4404)
    model = BloomForCausalLM(BloomConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()
