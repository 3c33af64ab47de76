"""A tiny InternLM2 (modeling_internlm2.py layout) driven with an external book-style KVCache.

InternLM2ForCausalLM -> model (tok_embeddings, layers ModuleList, norm) + output.  Each layer has
attention_norm / attention / ffn_norm / feed_forward (w1, w3, w2).  The attention keeps InternLM2's
packed wqkv: for every kv head a group of (heads_per_kv queries, 1 key, 1 value), so the weight
rows are laid out [(kv0: q q q q k v), (kv1: q q q q k v)].  GQA 8/2, head_dim 8, rotate_half rotary
(base 1e6), explicit matmul + -inf causal mask built by the model from the cache offset.

Cache (book-cache): cache = mod.KVCache(n_layers=3); model.reset_kv_cache(); model(prompt,
cache=cache); model(tok, cache=cache).  model.current_pos tracks positions.  Correct.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.attention", "model.layers.1.attention", "model.layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "InternLM2 packed wqkv grouped per kv head (gs = 2 + heads/kv), rotate_half rotary, "
    "LLMs-from-scratch KVCache(n_layers).get/update with model.current_pos",
}


@dataclass
class InternLM2Config:
    vocab_size: int = 144
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 64


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def get_all(self):
        return self.cache

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


class InternLM2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class InternLM2RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(x.dtype) * self.inv_freq[None, None, :].to(x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class InternLM2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.wqkv = nn.Linear(
            self.hidden_size,
            (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim,
            bias=False,
        )
        self.wo = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = InternLM2RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, config.rope_theta
        )

    def forward(self, hidden_states, mask, position_ids, cache=None):
        bsz, q_len, _ = hidden_states.size()
        qkv_states = self.wqkv(hidden_states)
        gs = 2 + self.num_key_value_groups
        qkv_states = qkv_states.view(bsz, q_len, self.num_key_value_heads, gs, self.head_dim)
        query_states = qkv_states[..., : self.num_key_value_groups, :]
        query_states = query_states.reshape(bsz, q_len, self.num_heads, self.head_dim)
        key_states = qkv_states[..., -2, :]
        value_states = qkv_states[..., -1, :]
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin

        if cache is not None:
            prev = cache.get(self.layer_idx)
            if prev is not None:
                key_states = torch.cat([prev[0], key_states], dim=2)
                value_states = torch.cat([prev[1], value_states], dim=2)
            cache.update(self.layer_idx, (key_states, value_states))

        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / self.head_dim**0.5
        attn_weights = attn_weights.masked_fill(mask, float("-inf"))
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.wo(attn_output)


class InternLM2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class InternLM2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention = InternLM2Attention(config, layer_idx)
        self.feed_forward = InternLM2MLP(config)
        self.attention_norm = InternLM2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = InternLM2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, mask, position_ids, cache=None):
        hidden_states = hidden_states + self.attention(
            self.attention_norm(hidden_states), mask, position_ids, cache
        )
        hidden_states = hidden_states + self.feed_forward(self.ffn_norm(hidden_states))
        return hidden_states


class InternLM2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [InternLM2DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = InternLM2RMSNorm(config.hidden_size, config.rms_norm_eps)


class InternLM2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = InternLM2Model(config)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0

    def forward(self, input_ids, cache=None):
        bsz, num_tokens = input_ids.shape
        x = self.model.tok_embeddings(input_ids)
        if cache is not None:
            pos_start = self.current_pos
            self.current_pos += num_tokens
        else:
            pos_start = 0
        pos_end = pos_start + num_tokens
        # True = masked: keys after the query's own absolute position
        mask = torch.triu(
            torch.ones(num_tokens, pos_end, device=x.device, dtype=torch.bool),
            diagonal=pos_start + 1,
        )[None, None]
        position_ids = torch.arange(pos_start, pos_end, device=x.device).unsqueeze(0)
        for layer in self.model.layers:
            x = layer(x, mask, position_ids, cache)
        return self.output(self.model.norm(x))


def make_model():
    torch.manual_seed(1)
    model = InternLM2ForCausalLM(InternLM2Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, InternLM2RMSNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
    return model.eval()
