"""Bark's semantic (text -> semantic tokens) causal model, after transformers' modeling_bark.py.

BarkSemanticModel / BarkCausalModel: input_embeds_layer, position_embeds_layer (learned, block_size
positions), layers.N (BarkBlock: layernorm_1, attn, layernorm_2, mlp with in_proj/out_proj and GELU),
layernorm_final, lm_head (no bias).  BarkLayerNorm is built with bias=False (config.bias False), so the
norms are gain-only LayerNorms.  BarkSelfAttention: one fused `att_proj` (hidden -> 3 * hidden) split
on the last dim, `_split_heads` view (b, s, h, d).permute(0, 2, 1, 3), a `bias` buffer tril(block_size)
used as the causal mask sliced [key_len - query_len : key_len, :key_len], masked_fill with finfo.min,
q @ k^T * (1 / sqrt(head_dim)), softmax, @ v, `_merge_heads`, `out_proj`.  MHA with 4 heads of 16.
Cache: hf legacy tuples `(key, value)` per layer in (b, h, s, d), concatenated on dim -2; positions
start at past_key_values[0][0].size(-2).  Correct everywhere.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "modeling_bark.py BarkCausalModel (semantic): fused att_proj split, learned positions from the past "
    "length, tril `bias` buffer sliced by key/query length, gain-only BarkLayerNorm, legacy (k, v) tuples",
}


class BarkLayerNorm(nn.Module):
    def __init__(self, hidden_size, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, eps=1e-5)


class BarkSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.att_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=config.bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.bias)
        bs = config.block_size
        self.register_buffer(
            "bias", torch.tril(torch.ones((bs, bs), dtype=torch.bool)).view(1, 1, bs, bs), persistent=False
        )

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        tensor = tensor.transpose(1, 2).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.num_heads * self.head_dim,))

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        query_length, key_length = query.size(-2), key.size(-2)
        causal = self.bias[:, :, key_length - query_length : key_length, :key_length]
        attn_weights = attn_weights.masked_fill(~causal, torch.finfo(attn_weights.dtype).min)
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        query, key, value = self.att_proj(hidden_states).split(self.embed_dim, dim=2)
        query = self._split_heads(query)
        key = self._split_heads(key)
        value = self._split_heads(value)
        if past_key_values is not None:
            key = torch.cat((past_key_values[0], key), dim=-2)
            value = torch.cat((past_key_values[1], value), dim=-2)
        present = (key, value) if use_cache else None
        attn_output = self._merge_heads(self._attn(query, key, value))
        return self.out_proj(attn_output), present


class BarkMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.in_proj = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=config.bias)
        self.out_proj = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x):
        return self.out_proj(F.gelu(self.in_proj(x)))


class BarkBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layernorm_1 = BarkLayerNorm(config.hidden_size, bias=config.bias)
        self.attn = BarkSelfAttention(config)
        self.layernorm_2 = BarkLayerNorm(config.hidden_size, bias=config.bias)
        self.mlp = BarkMLP(config)

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        attn_out, present = self.attn(self.layernorm_1(hidden_states), past_key_values, use_cache)
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.layernorm_2(hidden_states))
        return hidden_states, present


class BarkCausalModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.input_embeds_layer = nn.Embedding(config.input_vocab_size, config.hidden_size)
        self.position_embeds_layer = nn.Embedding(config.block_size, config.hidden_size)
        self.layers = nn.ModuleList([BarkBlock(config) for _ in range(config.num_layers)])
        self.layernorm_final = BarkLayerNorm(config.hidden_size, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden_size, config.output_vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        seq_length = input_ids.shape[-1]
        past_length = past_key_values[0][0].size(-2) if past_key_values is not None else 0
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.layers))
        position_ids = torch.arange(past_length, seq_length + past_length, device=input_ids.device).unsqueeze(0)
        hidden_states = self.input_embeds_layer(input_ids) + self.position_embeds_layer(position_ids)
        present_key_values = () if use_cache else None
        for block, past in zip(self.layers, past_key_values):
            hidden_states, present = block(hidden_states, past_key_values=past, use_cache=use_cache)
            if use_cache:
                present_key_values = present_key_values + (present,)
        logits = self.lm_head(self.layernorm_final(hidden_states))
        return SimpleNamespace(logits=logits, past_key_values=present_key_values)


def make_model():
    torch.manual_seed(1501)
    config = SimpleNamespace(
        block_size=64, input_vocab_size=96, output_vocab_size=96, num_layers=3,
        num_heads=4, hidden_size=64, bias=False,
    )
    model = BarkCausalModel(config)
    g = torch.Generator().manual_seed(15011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BarkLayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
