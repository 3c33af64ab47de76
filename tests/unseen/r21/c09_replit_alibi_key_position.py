"""Replit Code (replit/replit-code-v1-3b remote code, an MPT-derived ReplitLM) with attn_impl="torch":
one fused Wqkv, optional qk_ln (full-width LayerNorm on the query and key projections before the head
split), scaled_multihead_dot_product_attention with keys rearranged to "b h d s", the model-level
ALiBi attn_bias (build_alibi_bias with gen_slopes and alibi_bias_max 8) added after the softmax
scale, a tril causal mask filled with finfo.min, out_proj. Pre-norm block (ln_1, attn, ln_2, MLP).
einops.rearrange is written out with view/permute.

This file: correct (8 heads of 8, key-position ALiBi (full=False), no qk_ln)."""

import math

import torch
from torch import nn


class ReplitConfig:
    d_model = 64
    n_heads = 8
    expansion_ratio = 2
    attn_config = {"attn_impl": "torch", "alibi": True, "alibi_bias_max": 8, "qk_ln": False, "full_alibi": False}


def gen_slopes(n_heads, alibi_bias_max=8):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float64)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full=False, alibi_bias_max=8, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.float64).view(1, 1, 1, seq_len)
    if full:
        alibi_bias = alibi_bias - torch.arange(1 - seq_len, 1, dtype=torch.float64).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)
    slopes = gen_slopes(n_heads, alibi_bias_max)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def scaled_multihead_dot_product_attention(query, key, value, n_heads, softmax_scale=None, attn_bias=None, is_causal=False):
    b, s_q, d_model = query.shape
    s_k = key.shape[1]
    d = d_model // n_heads
    q = query.view(b, s_q, n_heads, d).permute(0, 2, 1, 3)
    k = key.view(b, s_k, n_heads, d).permute(0, 2, 3, 1)
    v = value.view(b, s_k, n_heads, d).permute(0, 2, 1, 3)
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        attn_weight = attn_weight + attn_bias[:, :, -s_q:, -s_k:]
    min_val = torch.finfo(q.dtype).min
    if is_causal:
        causal_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        attn_weight = attn_weight.masked_fill(~causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.matmul(v)
    return out.permute(0, 2, 1, 3).reshape(b, s_q, n_heads * d)


class MultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads, qk_ln=False):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.qk_ln = qk_ln
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        if qk_ln:
            self.q_ln = nn.LayerNorm(d_model)
            self.k_ln = nn.LayerNorm(d_model)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, attn_bias=None):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)
        if self.qk_ln:
            query = self.q_ln(query)
            key = self.k_ln(key)
        context = scaled_multihead_dot_product_attention(
            query, key, value, self.n_heads, attn_bias=attn_bias, is_causal=True
        )
        return self.out_proj(context)


class MPTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = MultiheadAttention(config.d_model, config.n_heads, config.attn_config["qk_ln"])
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.up_proj = nn.Linear(config.d_model, config.expansion_ratio * config.d_model, bias=False)
        self.down_proj = nn.Linear(config.expansion_ratio * config.d_model, config.d_model, bias=False)

    def forward(self, x, attn_bias=None):
        x = x + self.attn(self.ln_1(x), attn_bias=attn_bias)
        return x + self.down_proj(nn.functional.gelu(self.up_proj(self.ln_2(x))))


class ReplitModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([MPTBlock(config)])
        self.norm_f = nn.LayerNorm(config.d_model)

    def _attn_bias(self, seq_len, dtype):
        cfg = self.config.attn_config
        if not cfg["alibi"]:
            return None
        return build_alibi_bias(self.config.n_heads, seq_len, full=cfg["full_alibi"],
                                alibi_bias_max=cfg["alibi_bias_max"], dtype=dtype)

    def forward(self, inputs_embeds):
        attn_bias = self._attn_bias(inputs_embeds.shape[1], inputs_embeds.dtype)
        x = inputs_embeds
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias)
        return self.norm_f(x)


def make_replit():
    torch.manual_seed(2109)
    model = ReplitModel(ReplitConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_replit",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "alibi",
    },
    "style": 'Replit Code / MPT torch attention, key-position ALiBi bias: correct',
}
