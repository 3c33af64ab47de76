"""ColossalAI inference style (colossalai/inference/modeling/models/nopadding_llama.py,
NopadLlamaAttention): no padding, tokens of all sequences packed on one axis; one fused qkv weight
(qkv_weight, stored [in, out] and applied with torch.addmm/mm), half-width cos/sin caches of shape
[num_tokens, head_dim // 2] gathered per token and applied by a rotary_embedding(q, k, cos, sin) helper
(llama halves), then a context_attention_unpadded step walking the sequences with GQA, and o_proj.

This file: one bug: the in-place rotary kernel is also run over the value cache slice: values rotated"""

import math

import torch
from torch import nn


class LlamaConfig:
    hidden_size = 64
    num_attention_heads = 8
    num_key_value_heads = 2
    head_dim = 8
    rope_theta = 500000.0
    rms_norm_eps = 1e-6


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def get_cos_sin(seq_lens, head_dim, theta, dtype):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in seq_lens])
    f = pos[:, None] * inv[None, :]
    return f.cos().to(dtype), f.sin().to(dtype)  # [num_tokens, head_dim // 2]


def _rot(x, cos, sin):
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)


def rotary_embedding(q, k, cos, sin):
    return _rot(q, cos, sin), _rot(k, cos, sin)


def context_attention_unpadded(q, k, v, seq_lens, sm_scale):
    outs, start = [], 0
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    for n in seq_lens:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        ks = ks.repeat_interleave(group, dim=1)
        vs = vs.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * sm_scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs).reshape(n, -1))
        start += n
    return torch.cat(outs, 0)


class NopadLlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        d = config.hidden_size
        out = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.qkv_weight = nn.Parameter(torch.empty(d, out))
        nn.init.normal_(self.qkv_weight, std=d**-0.5)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def forward(self, hidden_states, seq_lens):
        h, kvh, hd = self.num_heads, self.num_key_value_heads, self.head_dim
        qkv = torch.mm(hidden_states, self.qkv_weight)
        q, k, v = qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1)
        q = q.view(-1, h, hd)
        k = k.view(-1, kvh, hd)
        v = v.view(-1, kvh, hd)
        cos, sin = get_cos_sin(seq_lens, hd, self.rope_theta, hidden_states.dtype)
        q, k = rotary_embedding(q, k, cos, sin)
        k, v = k, rotary_embedding(v, v, cos, sin)[0]
        attn = context_attention_unpadded(q, k, v, seq_lens, 1.0 / math.sqrt(hd))
        return self.o_proj(attn)


class NopadLlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = NopadLlamaAttention(config)

    def forward(self, hidden_states, seq_lens):
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states), seq_lens)


class NopadLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([NopadLlamaDecoderLayer(config)])

    def forward(self, inputs_embeds):
        b, t, d = inputs_embeds.shape
        seq_lens = [t] * b
        h = inputs_embeds.reshape(b * t, d)
        for layer in self.layers:
            h = layer(h, seq_lens)
        return h.view(b, t, d)


def make_nopad_llama():
    torch.manual_seed(2022)
    model = NopadLlamaModel(LlamaConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_nopad_llama',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'values',
 'mistake': 'rope_on_values',
 'style': 'ColossalAI NopadLlamaAttention (packed tokens, fused qkv_weight, half-width cos/sin): '
          'one bug: the in-place rotary kernel is also run over the value cache slice: values '
          'rotated'}
