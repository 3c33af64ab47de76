"""LLaDA (ML-GSAI/LLaDA, modeling_llada.py: OLMo-derived code for a masked-diffusion language
model) style block: LLaDALlamaBlock with separate q_proj/k_proj/v_proj and attn_out inside the
block, optional OLMo attention LayerNorm on the full-width projections (attention_layer_norm),
RotaryEmbedding (rotate_half over a (B, nh, T, hs) view), ALiBi via alibi_attention_bias
(symmetric |i - j| for bidirectional attention), GQA by repeat_interleave in
_scaled_dot_product_attention, and no causal mask: LLaDA denoises with bidirectional attention.

This file: correct (bidirectional, ALiBi with symmetric -slope * |i - j| from alibi_attention_bias, 4 heads of 16, no rotary, no QK norm)."""

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelConfig:
    d_model = 64
    n_heads = 4
    n_kv_heads = 4
    mlp_hidden_size = 128
    rope = False
    rope_theta = 500000.0
    alibi = True
    alibi_bias_max = 8.0
    attention_layer_norm = False
    clip_qkv = None
    layer_norm_eps = 1e-5
    n_layers = 1


class LayerNorm(nn.Module):
    """OLMo's default LayerNorm with an elementwise affine transform."""

    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.normalized_shape = (size,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, weight=self.weight, bias=self.bias, eps=self.eps)


class RMSLayerNorm(nn.Module):
    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        og_dtype = x.dtype
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return (self.weight * x).to(og_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dim = config.d_model // config.n_heads
        self.rope_theta = config.rope_theta

    def get_rotary_embedding(self, seq_len, device, dtype):
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float64) / self.dim)
        )
        seq = torch.arange(seq_len, device=device, dtype=torch.float64)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        pos_sin, pos_cos = positions.sin()[None, None, :, :], positions.cos()[None, None, :, :]
        return pos_sin.to(dtype), pos_cos.to(dtype)

    def rotate_half(self, x):
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return (t * pos_cos) + (self.rotate_half(t) * pos_sin)

    def forward(self, q, k):
        query_len, key_len = q.shape[-2], k.shape[-2]
        pos_sin, pos_cos = self.get_rotary_embedding(key_len, q.device, q.dtype)
        q_ = self.apply_rotary_pos_emb(
            pos_sin[:, :, key_len - query_len : key_len, :],
            pos_cos[:, :, key_len - query_len : key_len, :],
            q,
        )
        k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k)
        return q_, k_


def alibi_attention_bias(seq_len: int, config: ModelConfig, device, dtype) -> torch.Tensor:
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.float64, device=device).view(1, 1, 1, seq_len)
    # shape: (1, 1, seq_len, seq_len)
    alibi_bias = alibi_bias - torch.arange(1 - seq_len, 1, dtype=torch.float64, device=device).view(
        1, 1, seq_len, 1
    )
    alibi_bias.abs_().mul_(-1)
    # shape: (n_heads,)
    m = torch.arange(1, config.n_heads + 1, dtype=torch.float64, device=device)
    m.mul_(config.alibi_bias_max / config.n_heads)
    # shape: (1, n_heads, seq_len, seq_len)
    return (alibi_bias * (1.0 / (2 ** m.view(1, config.n_heads, 1, 1)))).to(dtype)


class LLaDALlamaBlock(nn.Module):
    def __init__(self, layer_id: int, config: ModelConfig):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        head_dim = config.d_model // config.n_heads
        self.attn_norm = RMSLayerNorm(config.d_model, config.layer_norm_eps)
        self.ff_norm = RMSLayerNorm(config.d_model, config.layer_norm_eps)
        self.q_norm = self.k_norm = None
        if config.attention_layer_norm:
            self.q_norm = LayerNorm(config.d_model, config.layer_norm_eps)
            self.k_norm = LayerNorm(config.n_kv_heads * head_dim, config.layer_norm_eps)
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * head_dim, bias=False)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.ff_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, config.d_model, bias=False)
        if config.rope:
            self.rotary_emb = RotaryEmbedding(config)

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, is_causal=False):
        num_kv_heads = k.size(1)
        num_q_heads = q.size(1)
        if num_q_heads != num_kv_heads:
            assert num_q_heads % num_kv_heads == 0
            k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)
            v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)
        # manual path (F.scaled_dot_product_attention without a fused kernel on this device)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        if attn_mask is not None:
            att = att + attn_mask
        att = torch.softmax(att, dim=-1)
        return torch.matmul(att, v)

    def attention(self, q, k, v, attention_bias: Optional[torch.Tensor] = None):
        B, T, C = q.size()
        dtype = k.dtype
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q).to(dtype=dtype)
            k = self.k_norm(k).to(dtype=dtype)
        # shape: (B, nh, T, hs)
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        k = k.view(B, T, self.config.n_kv_heads, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, self.config.n_kv_heads, C // self.config.n_heads).transpose(1, 2)
        if self.config.rope:
            q, k = self.rotary_emb(q, k)
        att = self._scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, is_causal=False)
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att)

    def forward(self, x, attention_bias=None):
        x_normed = self.attn_norm(x)
        q = self.q_proj(x_normed)
        k = self.k_proj(x_normed)
        v = self.v_proj(x_normed)
        if self.config.clip_qkv is not None:
            q.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            k.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            v.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        x = x + self.attention(q, k, v, attention_bias)
        og_x = x
        x = self.ff_norm(x)
        x = self.ff_out(F.silu(self.ff_proj(x)) * self.up_proj(x))
        return og_x + x


class LLaDAModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                blocks=nn.ModuleList([LLaDALlamaBlock(i, config) for i in range(config.n_layers)]),
                ln_f=RMSLayerNorm(config.d_model, config.layer_norm_eps),
            )
        )

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        attention_bias = None
        if self.config.alibi:
            attention_bias = alibi_attention_bias(seq_len, self.config, inputs_embeds.device, inputs_embeds.dtype)
        x = inputs_embeds
        for block in self.transformer.blocks:
            x = block(x, attention_bias=attention_bias)
        return self.transformer.ln_f(x)


def make_llada_model():
    torch.manual_seed(3028)
    model = LLaDAModel(ModelConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (RMSLayerNorm, LayerNorm)):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, LayerNorm):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_llada_model',
 'kind': 'multihead',
 'ok': True,
 'layer': 'transformer.blocks.0',
 'structure': {'heads': 4,
               'kv_heads': 4,
               'head_dim': 16,
               'causal': False,
               'cross': False,
               'rope': None,
               'qk_norm': None,
               'window': None,
               'bias': 'alibi'},
 'style': 'LLaDA LLaDALlamaBlock (modeling_llada.py): correct (bidirectional ALiBi, alibi_bias_max '
          '8 over 4 heads, no rope)'}
