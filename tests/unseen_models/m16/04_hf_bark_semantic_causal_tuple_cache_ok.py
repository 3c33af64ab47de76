"""Bark's semantic (text-to-semantic) GPT, after transformers' modeling_bark.py BarkCausalModel.

BarkCausalModel: input_embeds_layer, position_embeds_layer (learned, block_size 64), layers.N
(BarkBlock: layernorm_1 -> attn -> + residual -> layernorm_2 -> mlp in_proj/GELU/out_proj -> +
residual), layernorm_final, lm_head.  config.bias is False, so BarkLayerNorm has a weight and no bias
and no Linear has a bias.  BarkSelfAttention: fused att_proj split into q, k, v by embed_dim,
_split_heads to (b, h, s, d), matmul * 1/sqrt(head_dim), causal mask from the registered tril buffer
`bias` sliced [key_length - query_length : key_length, :key_length], masked_fill finfo.min, softmax,
_merge_heads, out_proj.  MHA 4 x 16.
Cache: hf tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; each entry (key, value) in
(b, h, s, d) concatenated on dim -2; positions start at past_key_values[0][0].size(-2).
Returns an object with `.logits` and `.past_key_values`.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "layers.0.attn",
        "layers.1.attn",
        "layers.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "modeling_bark.py BarkCausalModel (semantic model): learned positions offset by the past length, bias-free "
    "BarkLayerNorm, fused att_proj split, tril `bias` buffer sliced [k-q:k, :k], finfo.min fill, legacy (k, v) tuples",
}


class BarkLayerNorm(nn.Module):
    def __init__(self, ndim, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, eps=1e-5)


class BarkSelfAttention(nn.Module):
    def __init__(self, config, is_causal=False):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.att_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.bias)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)
        self.is_causal = is_causal
        if is_causal:
            block_size = config.block_size
            bias = torch.tril(torch.ones((block_size, block_size), dtype=bool)).view(1, 1, block_size, block_size)
            self.register_buffer("bias", bias, persistent=False)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.transpose(1, 2).contiguous()
        return tensor.view(tensor.size()[:-2] + (num_heads * attn_head_size,))

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if self.is_causal:
            query_length, key_length = query.size(-2), key.size(-2)
            attn_weights = attn_weights.masked_fill(
                self.bias[:, :, key_length - query_length : key_length, :key_length] == 0,
                torch.finfo(attn_weights.dtype).min,
            )
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        query, key, value = self.att_proj(hidden_states).split(self.embed_dim, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        if past_key_values is not None:
            past_key, past_value = past_key_values
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None
        attn_output, attn_weights = self._attn(query, key, value)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, present


class BarkMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.in_proj = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=config.bias)
        self.out_proj = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.gelu = nn.GELU()

    def forward(self, hidden_states):
        return self.out_proj(self.gelu(self.in_proj(hidden_states)))


class BarkBlock(nn.Module):
    def __init__(self, config, is_causal=False):
        super().__init__()
        self.layernorm_1 = BarkLayerNorm(config.hidden_size, bias=config.bias)
        self.layernorm_2 = BarkLayerNorm(config.hidden_size, bias=config.bias)
        self.attn = BarkSelfAttention(config, is_causal=is_causal)
        self.mlp = BarkMLP(config)

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        intermediary_hidden_states = self.layernorm_1(hidden_states)
        attn_output, present = self.attn(
            intermediary_hidden_states, past_key_values=past_key_values, use_cache=use_cache
        )
        intermediary_hidden_states = hidden_states + attn_output
        intermediary_hidden_states = intermediary_hidden_states + self.mlp(
            self.layernorm_2(intermediary_hidden_states)
        )
        return intermediary_hidden_states, present


class BarkCausalModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.input_embeds_layer = nn.Embedding(config.input_vocab_size, config.hidden_size)
        self.position_embeds_layer = nn.Embedding(config.block_size, config.hidden_size)
        self.layers = nn.ModuleList([BarkBlock(config, is_causal=True) for _ in range(config.num_layers)])
        self.layernorm_final = BarkLayerNorm(config.hidden_size, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden_size, config.output_vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        input_embeds = self.input_embeds_layer(input_ids)
        seq_length = input_ids.shape[-1]
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.layers))
        else:
            past_length = past_key_values[0][0].size(-2)
        position_ids = torch.arange(
            past_length, seq_length + past_length, dtype=torch.long, device=input_ids.device
        ).unsqueeze(0)
        position_embeds = self.position_embeds_layer(position_ids)
        hidden_states = input_embeds + position_embeds
        present_key_values = () if use_cache else None
        for block, past_layer_key_values in zip(self.layers, past_key_values):
            hidden_states, present = block(
                hidden_states, past_key_values=past_layer_key_values, use_cache=use_cache
            )
            if use_cache:
                present_key_values = present_key_values + (present,)
        hidden_states = self.layernorm_final(hidden_states)
        logits = self.lm_head(hidden_states)
        return SimpleNamespace(logits=logits, past_key_values=present_key_values)


def make_model():
    torch.manual_seed(1604)
    config = SimpleNamespace(
        input_vocab_size=96,
        output_vocab_size=96,
        hidden_size=64,
        num_heads=4,
        num_layers=3,
        block_size=64,
        bias=False,
    )
    model = BarkCausalModel(config)
    g = torch.Generator().manual_seed(16041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BarkLayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()
