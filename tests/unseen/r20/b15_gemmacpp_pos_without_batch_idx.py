"""gemma.cpp style (google/gemma.cpp, gemma/gemma-inl.h) ported to torch: the attention walks the
prefill batch token by token and head by head like the C++ loops: QKV from one fused qkv_einsum_w
laid out [heads + 2 * kv_heads, head_dim, model_dim], per-head RMSNorm with (1 + scale) for q and k
(Gemma 3 use_qk_norm), PositionalEncodingQK (rope on the two halves), queries multiplied by
query_scale = 1 / sqrt(query_pre_attn_scalar), a local attention window (start_pos from
attention_window_size), a softmax over the visible positions, the weighted sum of v, and the output
einsum attn_vec_einsum_w [model_dim, heads * head_dim].

This file: one bug: every token of the prefill batch rotated at batch_start (0) instead of batch_start + batch_idx"""

import math

import torch
from torch import nn


class LayerConfig:
    model_dim = 64
    heads = 4
    kv_heads = 2
    qkv_dim = 16
    query_pre_attn_scalar = 16
    attention_window_size = 8
    rope_base = 10000.0
    use_qk_norm = True


def rms_norm_scaled(x, scale, eps=1e-6):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * (1.0 + scale)


def positional_encoding_qk(x, pos, base):
    """Rotate one head vector (dim) for integer position pos: first half against second half."""
    dim = x.shape[-1]
    half = dim // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / dim)
    theta = (float(pos) * inv).to(x.dtype)
    c, s = theta.cos(), theta.sin()
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)


class GemmaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        n = cfg.heads + 2 * cfg.kv_heads
        self.qkv_einsum_w = nn.Parameter(torch.randn(n, cfg.qkv_dim, cfg.model_dim) * cfg.model_dim**-0.5)
        self.attn_vec_einsum_w = nn.Parameter(
            torch.randn(cfg.model_dim, cfg.heads * cfg.qkv_dim) * (cfg.heads * cfg.qkv_dim) ** -0.5
        )
        self.query_norm_scale = nn.Parameter(torch.empty(cfg.qkv_dim).uniform_(-0.5, 0.5))
        self.key_norm_scale = nn.Parameter(torch.empty(cfg.qkv_dim).uniform_(-0.5, 0.5))

    def forward(self, x):
        cfg = self.cfg
        B, T, _ = x.shape
        H, KV, D = cfg.heads, cfg.kv_heads, cfg.qkv_dim
        query_scale = 1.0 / math.sqrt(cfg.query_pre_attn_scalar)
        qkv = torch.einsum("ndm,btm->btnd", self.qkv_einsum_w, x)
        q_all, k_all, v_all = qkv[:, :, :H], qkv[:, :, H:H + KV], qkv[:, :, H + KV:]
        keys = torch.empty_like(k_all)
        queries = torch.empty_like(q_all)
        for b in range(B):
            for batch_idx in range(T):
                pos = 0  # batch_start; batch_idx forgotten
                for kv in range(KV):
                    kk = k_all[b, batch_idx, kv]
                    if cfg.use_qk_norm:
                        kk = rms_norm_scaled(kk, self.key_norm_scale)
                    keys[b, batch_idx, kv] = positional_encoding_qk(kk, pos, cfg.rope_base)
                for h in range(H):
                    qq = q_all[b, batch_idx, h]
                    if cfg.use_qk_norm:
                        qq = rms_norm_scaled(qq, self.query_norm_scale)
                    qq = positional_encoding_qk(qq, pos, cfg.rope_base)
                    queries[b, batch_idx, h] = qq * query_scale
        att_out = torch.zeros(B, T, H, D, dtype=x.dtype, device=x.device)
        group = H // KV
        for b in range(B):
            for pos in range(T):
                start_pos = max(0, pos - cfg.attention_window_size + 1)
                for h in range(H):
                    kv = h // group
                    q = queries[b, pos, h]
                    logits = keys[b, start_pos:pos + 1, kv] @ q
                    probs = torch.softmax(logits, dim=-1)
                    att_out[b, pos, h] = probs @ v_all[b, start_pos:pos + 1, kv]
        return torch.einsum("mk,btk->btm", self.attn_vec_einsum_w, att_out.reshape(B, T, H * D))


class GemmaLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.pre_attention_norm_scale = nn.Parameter(torch.empty(cfg.model_dim).uniform_(-0.3, 0.3))
        self.attention = GemmaAttention(cfg)

    def forward(self, x):
        return x + self.attention(rms_norm_scaled(x, self.pre_attention_norm_scale))


class GemmaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList([GemmaLayer(cfg)])

    def forward(self, inputs_embeds):
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h)
        return h


def make_gemmacpp_gemma3():
    torch.manual_seed(2045)
    return GemmaModel(LayerConfig()).eval()


EXPECT = {'target': 'make_gemmacpp_gemma3',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.attention',
 'stage': 'rotated_queries',
 'mistake': 'rope_positions',
 'style': 'gemma.cpp gemma-inl.h Attention (per-token/per-head loops): one bug: every token of the '
          'prefill batch rotated at batch_start (0) instead of batch_start + batch_idx'}
