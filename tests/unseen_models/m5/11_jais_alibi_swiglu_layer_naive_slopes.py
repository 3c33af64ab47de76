"""Jais in the shape of its modeling_jais.py (a GPT-2 derivative; written from memory, in my own
words): `transformer.wte` with no learned positions (position_embedding_type = "alibi"), GPT-2
Conv1D layers (`attn.c_attn` fused q|k|v with bias, `attn.c_proj`), SwiGLU MLP (`c_fc`, `c_fc2`,
`c_proj`), LayerNorms with bias, `transformer.ln_f`, untied `lm_head`.  The ALiBi bias comes from
a model-level `transformer.relative_pe` module (slopes from the standard get_slopes, including the
non-power-of-two rule: 6 heads -> 2^-2, 2^-4, 2^-6, 2^-8, 2^-1, 2^-3), bias -slope * (i - j), added
after the 1/sqrt(head_dim) scale (scale_qk_dot_by_d = False).  6 heads of 16 (d 96), 3 layers.

config.alibi_recompute_layers = [1]: layer 1 rebuilds its slopes locally with the one-line formula
2^(-8 (h + 1) / n_heads), which is only right for a power-of-two head count.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  past_key_values is a tuple per layer of (key, value), each (batch, heads, seq, 16).

Slip: `transformer.h.1.attn` uses non-standard ALiBi slopes (stage `biased_scores`, `bias_slopes`).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "transformer.h.1.attn",
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "style": "modeling_jais.py: GPT-2 Conv1D c_attn, ALiBi from transformer.relative_pe (6 heads, non-power-of-2 "
    "slopes), SwiGLU c_fc/c_fc2, tuple cache; slip: layer 1 recomputes slopes as 2^(-8(h+1)/6)",
}


class JaisConfig:
    vocab_size = 150
    n_embd = 96
    n_inner = 128
    n_layer = 3
    n_head = 6
    layer_norm_epsilon = 1e-5
    position_embedding_type = "alibi"
    scale_qk_dot_by_d = False
    alibi_recompute_layers = [1]


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.08)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest) + get_slopes(2 * closest)[0::2][: n - closest]


def alibi_from_slopes(slopes, q_len, k_len, dtype):
    context_position = torch.arange(k_len - q_len, k_len)[:, None]
    memory_position = torch.arange(k_len)[None, :]
    relative_position = (memory_position - context_position).abs()  # i - j below the diagonal
    bias = -slopes[:, None, None] * relative_position[None].to(torch.float64)
    return bias.to(dtype)  # (heads, q, k)


class AlibiPositionEmbeddingLayer(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.register_buffer(
            "slopes", torch.tensor(get_slopes(num_heads), dtype=torch.float64), persistent=False
        )

    def forward(self, q_len, k_len, dtype):
        return alibi_from_slopes(self.slopes, q_len, k_len, dtype)


class JaisAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.attn_scale_power = 1.0 if config.scale_qk_dot_by_d else 0.5
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.recompute_alibi = layer_idx in config.alibi_recompute_layers

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.num_heads * self.head_dim,))

    def _attn(self, query, key, value, position_bias):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** self.attn_scale_power, dtype=attn_weights.dtype
        )
        q_len, k_len = query.size(-2), key.size(-2)
        if self.recompute_alibi:
            slopes = torch.tensor(
                [2 ** (-8 * (h + 1) / self.num_heads) for h in range(self.num_heads)],
                dtype=torch.float64,
            )
            position_bias = alibi_from_slopes(slopes, q_len, k_len, attn_weights.dtype)
        attn_weights = attn_weights + position_bias.unsqueeze(0)
        causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal, attn_weights, mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, layer_past=None, use_cache=False, position_bias=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query)
        key = self._split_heads(key)
        value = self._split_heads(value)
        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None
        attn_output, _ = self._attn(query, key, value, position_bias)
        return self.c_proj(self._merge_heads(attn_output)), present


class JaisMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.c_fc2 = Conv1D(intermediate_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)

    def forward(self, hidden_states):
        return self.c_proj(self.c_fc(hidden_states) * F.silu(self.c_fc2(hidden_states)))


class JaisBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = JaisAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = JaisMLP(config.n_inner, config)

    def forward(self, hidden_states, layer_past, use_cache, position_bias):
        residual = hidden_states
        attn_output, present = self.attn(
            self.ln_1(hidden_states), layer_past, use_cache, position_bias
        )
        hidden_states = attn_output + residual
        return hidden_states + self.mlp(self.ln_2(hidden_states)), present


class JaisModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([JaisBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.relative_pe = AlibiPositionEmbeddingLayer(config.n_head)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)
        hidden_states = self.wte(input_ids)
        q_len = input_ids.shape[1]
        position_bias = self.relative_pe(q_len, past_length + q_len, hidden_states.dtype)
        presents = () if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(hidden_states, layer_past, use_cache, position_bias)
            if use_cache:
                presents = presents + (present,)
        return self.ln_f(hidden_states), presents


class CausalLMOutputWithCrossAttentions:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class JAISLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = JaisModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, presents = self.transformer(input_ids, past_key_values, use_cache)
        return CausalLMOutputWithCrossAttentions(self.lm_head(hidden_states), presents)


def make_model():
    torch.manual_seed(6111)
    model = JAISLMHeadModel(JaisConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()
