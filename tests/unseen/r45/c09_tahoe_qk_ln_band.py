"""Tahoe-x1 (Vevo Therapeutics) single-cell transformer, whose blocks are built from llm-foundry's
attention: one fused Wqkv split into query / key / value for grouped-query attention, optional
LayerNorm on the whole query and key projections (qk_ln), llm-foundry's torch attention path
(keys pre-transposed to (b, h, d, s), the kv heads expanded per group), an ALiBi bias built by the
model and handed to the layer, an optional sliding window, and a biased out_proj. Scaled to 64 wide.

This file: correct. Tahoe-x1 / llm-foundry attention with qk_ln (LayerNorm over the whole query and key projections) and sliding_window_size 3 on a bidirectional layer (tril/triu band, 7 keys)"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class TXConfig:
    d_model = 64
    n_heads = 4
    kv_n_heads = 4
    qk_ln = True
    alibi = False
    alibi_bias_max = 8
    sliding_window_size = 3  # -1: off
    is_causal = False
    expansion_ratio = 2


def gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float64, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full, alibi_bias_max, dtype, device):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.float64, device=device).view(
        1, 1, 1, seq_len
    )
    if full:
        # bidirectional: -|i - j|
        alibi_bias = alibi_bias - torch.arange(
            1 - seq_len, 1, dtype=torch.float64, device=device
        ).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)
    slopes = gen_slopes(n_heads, alibi_bias_max, device=device)
    return (alibi_bias * slopes).to(dtype)


def repeat_kv_for_gqa(hidden, n_rep):
    # hidden: (b, s, kv_n_heads, d) -> (b, s, kv_n_heads * n_rep, d), each kv head kept next to its copies
    if n_rep == 1:
        return hidden
    b, s, kv_n_heads, d = hidden.shape
    hidden = hidden[:, :, :, None, :].expand(b, s, kv_n_heads, n_rep, d)
    return hidden.reshape(b, s, kv_n_heads * n_rep, d)


def scaled_multihead_dot_product_attention(
    query,
    key,
    value,
    n_heads,
    kv_n_heads,
    softmax_scale=None,
    attn_bias=None,
    is_causal=False,
    sliding_window_size=-1,
):
    b, s_q, _ = query.shape
    s_k = key.shape[1]
    d = query.shape[-1] // n_heads
    q = query.view(b, s_q, n_heads, d).permute(0, 2, 1, 3)
    k = repeat_kv_for_gqa(key.view(b, s_k, kv_n_heads, d), n_heads // kv_n_heads).permute(
        0, 2, 3, 1
    )
    v = repeat_kv_for_gqa(value.view(b, s_k, kv_n_heads, d), n_heads // kv_n_heads).permute(
        0, 2, 1, 3
    )
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        attn_weight = attn_weight + attn_bias[:, :, -s_q:, -s_k:]
    min_val = torch.finfo(q.dtype).min
    if is_causal and s_q > 1:
        causal_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
        attn_weight = attn_weight.masked_fill(~causal_mask.view(1, 1, s_q, s_k), min_val)
    if sliding_window_size != -1:
        window_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
        window_mask = torch.tril(window_mask, diagonal=sliding_window_size)
        window_mask = torch.triu(window_mask, diagonal=-sliding_window_size)
        attn_weight = attn_weight.masked_fill(~window_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.matmul(v)
    return out.permute(0, 2, 1, 3).reshape(b, s_q, n_heads * d)


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.kv_n_heads = cfg.kv_n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.softmax_scale = 1 / math.sqrt(self.head_dim)
        self.qk_ln = cfg.qk_ln
        self.is_causal = cfg.is_causal
        self.sliding_window_size = cfg.sliding_window_size
        self.Wqkv = nn.Linear(self.d_model, self.d_model + 2 * self.kv_n_heads * self.head_dim)
        if self.qk_ln:
            self.q_ln = nn.LayerNorm(self.d_model)
            self.k_ln = nn.LayerNorm(self.kv_n_heads * self.head_dim)
        self.out_proj = nn.Linear(self.d_model, self.d_model)

    def forward(self, x, attn_bias=None):
        qkv = self.Wqkv(x)
        query, key, value = qkv.split(
            [self.d_model, self.kv_n_heads * self.head_dim, self.kv_n_heads * self.head_dim], dim=2
        )
        if self.qk_ln:
            dtype = query.dtype
            query = self.q_ln(query).to(dtype)
            key = self.k_ln(key).to(dtype)
        context = scaled_multihead_dot_product_attention(
            query,
            key,
            value,
            self.n_heads,
            self.kv_n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            is_causal=self.is_causal,
            sliding_window_size=self.sliding_window_size,
        )
        return self.out_proj(context)


class TXBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = GroupedQueryAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.up_proj = nn.Linear(cfg.d_model, cfg.expansion_ratio * cfg.d_model)
        self.down_proj = nn.Linear(cfg.expansion_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x, attn_bias=None):
        x = x + self.self_attn(self.norm1(x), attn_bias=attn_bias)
        return x + self.down_proj(F.gelu(self.up_proj(self.norm2(x))))


class TXModel(nn.Module):
    """Gene/expression embeddings (64 wide) -> one Tahoe-x1 block; the model builds the ALiBi bias."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.expression_encoder = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_model), nn.LayerNorm(cfg.d_model)
        )
        self.transformer_encoder = nn.Module()
        self.transformer_encoder.layers = nn.ModuleList([TXBlock(cfg)])
        self.norm_f = nn.LayerNorm(cfg.d_model)

    def forward(self, values):
        h = self.expression_encoder(values)
        attn_bias = None
        if self.cfg.alibi:
            attn_bias = build_alibi_bias(
                self.cfg.n_heads,
                h.shape[1],
                full=not self.cfg.is_causal,
                alibi_bias_max=self.cfg.alibi_bias_max,
                dtype=h.dtype,
                device=h.device,
            )
        for layer in self.transformer_encoder.layers:
            h = layer(h, attn_bias=attn_bias)
        return self.norm_f(h)


def make_tahoe_x1():
    torch.manual_seed(4509)
    model = TXModel(TXConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_tahoe_x1",
    "kind": "multihead",
    "ok": True,
    "layer": "transformer_encoder.layers.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": "full",
        "window": 7,
        "bias": None,
    },
    "style": "Tahoe-x1 (Vevo Therapeutics) (c09): correct: Tahoe-x1 / llm-foundry attention with "
    "qk_ln (LayerNorm over the whole query and key projections) and sliding_window_size 3 on "
    "a bidirectional layer (tril/triu band, 7 keys)",
}
