"""AI2 OLMo-repo-style sequential block (att_proj fused, attention_layer_norm over the full q / k width, GQA 4:2,
rotary); bug: when the clip_qkv branch was merged the q_norm line was lost, only the keys are normalized."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    mlp_ratio: int = 2
    clip_qkv: float = None
    attention_layer_norm: bool = True
    attention_layer_norm_with_affine: bool = True
    layer_norm_eps: float = 1e-5
    rope_theta: int = 10000
    max_sequence_length: int = 64

    @property
    def effective_n_kv_heads(self):
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


class LayerNorm(nn.Module):
    """OLMo's LayerNorm: optional affine weight, no bias."""

    def __init__(self, config, size=None, elementwise_affine=True, eps=1e-5):
        super().__init__()
        self.normalized_shape = (size or config.d_model,)
        self.eps = eps
        self.weight = (
            nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_affine else None
        )

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, weight=self.weight, bias=None, eps=self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.__cache = {}

    def get_rotary_embedding(self, seq_len, device, dtype):
        key = ("pos", seq_len, dtype)
        if key not in self.__cache:
            dim = self.config.d_model // self.config.n_heads
            inv_freq = 1.0 / (
                self.config.rope_theta
                ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
            )
            seq = torch.arange(seq_len, device=device, dtype=torch.float64)
            freqs = torch.einsum("i , j -> i j", seq, inv_freq)
            positions = torch.cat((freqs, freqs), dim=-1)
            self.__cache[key] = (
                positions.sin()[None, None].to(dtype),
                positions.cos()[None, None].to(dtype),
            )
        return self.__cache[key]

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


class OLMoSequentialBlock(nn.Module):
    def __init__(self, layer_id, config):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        head_dim = config.d_model // config.n_heads
        self.fused_dims = (
            config.d_model,
            config.effective_n_kv_heads * head_dim,
            config.effective_n_kv_heads * head_dim,
        )
        self.q_norm = None
        self.k_norm = None
        if config.attention_layer_norm:
            self.q_norm = LayerNorm(
                config,
                elementwise_affine=config.attention_layer_norm_with_affine,
                eps=config.layer_norm_eps,
            )
            self.k_norm = LayerNorm(
                config,
                size=head_dim * config.effective_n_kv_heads,
                elementwise_affine=config.attention_layer_norm_with_affine,
                eps=config.layer_norm_eps,
            )
        self.att_proj = nn.Linear(config.d_model, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.ff_proj = nn.Linear(config.d_model, config.mlp_ratio * config.d_model * 2, bias=False)
        self.ff_out = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=False)
        self.attn_norm = LayerNorm(config, eps=config.layer_norm_eps)
        self.ff_norm = LayerNorm(config, eps=config.layer_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def attention(self, q, k, v):
        B, T, C = q.size()
        dtype = k.dtype
        if self.k_norm is not None:
            k = self.k_norm(k).to(dtype=dtype)

        n_kv = self.config.effective_n_kv_heads
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        k = k.view(B, T, n_kv, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, n_kv, C // self.config.n_heads).transpose(1, 2)

        q, k = self.rotary_emb(q, k)
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=n_kv != self.config.n_heads
        )
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att)

    def forward(self, x):
        qkv = self.att_proj(self.attn_norm(x))
        if self.config.clip_qkv is not None:
            qkv.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        q, k, v = qkv.split(self.fused_dims, dim=-1)
        x = x + self.attention(q, k, v)
        og_x = x
        x, x_gate = self.ff_proj(self.ff_norm(x)).chunk(2, dim=-1)
        return og_x + self.ff_out(F.silu(x_gate) * x)


def make_block():
    block = OLMoSequentialBlock(0, ModelConfig())
    g = torch.Generator().manual_seed(31)
    with torch.no_grad():
        block.q_norm.weight.copy_(0.5 + torch.rand(64, generator=g))
        block.k_norm.weight.copy_(0.5 + torch.rand(32, generator=g))
    return block


EXPECT = {
    "target": "make_block",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "normed_queries",
    "mistake": "qk_norm_missing",
    "style": "AI2 OLMo repo OLMoSequentialBlock (att_proj split by fused_dims, attention(q, k, v) method, LayerNorm q_norm(d_model)/k_norm(kv width) without bias, RotaryEmbedding.rotate_half via view(B, nh, T, 2, hs//2), SDPA enable_gqa); q_norm built but never applied",
}
