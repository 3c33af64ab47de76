"""A tiny GPT-NeoX in the style of Hugging Face's modeling_gpt_neox.py: fused query_key_value
with the per-head [q|k|v] layout (view(B, T, H, 3*D)), partial rotary (rotary_pct = 0.25 of
each head, rotate_half inside the rotary slice), parallel residual, and a Cache object passed
as past_key_values.  forward(input_ids, past_key_values=None, use_cache=False) returns an
output with .logits and .past_key_values.  Positions come from cache.seen_tokens, which the
model advances once per call; one-token steps use SDPA without a mask.

Slip: the attention already calls layer_past.update(...) and uses what it returns, but the
model loop still carries the legacy "presents" code and calls past_key_values.update() again
with each layer's new keys/values.  The prompt pass is right; from the first decoded token on
every layer sees its cached keys/values twice.  The full forward is right.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "gpt_neox.layers.0.attention",
        "gpt_neox.layers.1.attention",
        "gpt_neox.layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "gpt_neox.layers.0.attention"},
    "style": "transformers modeling_gpt_neox.py (partial rotary, parallel residual, Cache.update); slip: "
    "legacy presents loop updates the cache a second time after the attention did",
}


@dataclass
class GPTNeoXConfig:
    vocab_size: int = 170
    hidden_size: int = 64
    num_attention_heads: int = 4
    intermediate_size: int = 256
    num_hidden_layers: int = 3
    rotary_pct: float = 0.25
    rotary_emb_base: int = 10000
    max_position_embeddings: int = 128
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True


class Cache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []
        self.seen_tokens = 0

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self):
        return self.seen_tokens


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Cache] = None


class GPTNeoXRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class GPTNeoXAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_attention_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_size = self.hidden_size // self.num_attention_heads
        self.rotary_ndims = int(self.head_size * config.rotary_pct)
        self.rotary_emb = GPTNeoXRotaryEmbedding(self.rotary_ndims, base=config.rotary_emb_base)
        self.scaling = self.head_size**-0.5
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, position_ids, layer_past=None, use_cache=False):
        B, T, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(B, T, self.num_attention_heads, 3 * self.head_size).transpose(1, 2)
        query, key, value = qkv.chunk(3, dim=-1)

        cos, sin = self.rotary_emb(position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rot, q_pass = query[..., : self.rotary_ndims], query[..., self.rotary_ndims :]
        k_rot, k_pass = key[..., : self.rotary_ndims], key[..., self.rotary_ndims :]
        query = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        key = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)

        present = (key, value) if use_cache else None
        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_idx)

        attn_output = F.scaled_dot_product_attention(
            query, key, value, is_causal=T > 1, scale=self.scaling
        )
        attn_output = attn_output.transpose(1, 2).reshape(B, T, self.hidden_size)
        return self.dense(attn_output), present


class GPTNeoXMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config, layer_idx)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, hidden_states, position_ids, layer_past=None, use_cache=False):
        attn_output, present = self.attention(
            self.input_layernorm(hidden_states),
            position_ids,
            layer_past=layer_past,
            use_cache=use_cache,
        )
        if self.use_parallel_residual:
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            hidden_states = mlp_output + attn_output + hidden_states
        else:
            attn_output = attn_output + hidden_states
            hidden_states = self.mlp(self.post_attention_layernorm(attn_output)) + attn_output
        return hidden_states, present


class GPTNeoXModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GPTNeoXLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = Cache()
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        T = input_ids.shape[1]
        position_ids = torch.arange(
            past_length, past_length + T, device=input_ids.device
        ).unsqueeze(0)

        hidden_states = self.embed_in(input_ids)
        for i, layer in enumerate(self.layers):
            hidden_states, present = layer(
                hidden_states, position_ids, layer_past=past_key_values, use_cache=use_cache
            )
            if use_cache:
                past_key_values.update(present[0], present[1], i)
        if past_key_values is not None:
            past_key_values.seen_tokens += T
        return self.final_layer_norm(hidden_states), past_key_values


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gpt_neox = GPTNeoXModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, past_key_values = self.gpt_neox(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        return CausalLMOutputWithPast(
            logits=self.embed_out(hidden_states),
            past_key_values=past_key_values if use_cache else None,
        )


def make_model():
    torch.manual_seed(19)
    model = GPTNeoXForCausalLM(GPTNeoXConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()
