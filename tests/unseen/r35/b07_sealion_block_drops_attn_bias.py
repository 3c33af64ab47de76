"""AI Singapore SEA-LION (MPT-7B architecture): fused Wqkv without bias, chunked into q/k/v,
optional qk_ln (LayerNorm over the full 64-wide q and k), ALiBi bias built once by the model
(gen_slopes / build_alibi_bias, alibi_bias_max 8) and sliced to the sequence, keys laid out
(b, h, d, s) for q.matmul(k), causal tril mask filled with finfo.min.

This file: one bug: MPTBlock receives the model's ALiBi attn_bias but calls self.attn without it."""

import math

import torch
from torch import nn


class SeaLionConfig:
    d_model = 64
    n_heads = 8
    expansion_ratio = 2
    max_seq_len = 128
    no_bias = True

    def __init__(self):
        self.attn_config = {
            "alibi": True,
            "alibi_bias_max": 8,
            "prefix_lm": False,
            "qk_ln": False,
            "softmax_scale": None,
            "full_alibi": True,
        }


def gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float64, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full=False, alibi_bias_max=8, device=None, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.float64, device=device).view(1, 1, 1, seq_len)
    if full:
        alibi_bias = alibi_bias - torch.arange(
            1 - seq_len, 1, dtype=torch.float64, device=device
        ).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)
    slopes = gen_slopes(n_heads, alibi_bias_max, device=device)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def scaled_multihead_dot_product_attention(
    query, key, value, n_heads, softmax_scale=None, attn_bias=None, is_causal=False
):
    b, s_q, _ = query.shape
    s_k = key.shape[1]
    q = query.view(b, s_q, n_heads, -1).permute(0, 2, 1, 3)  # b h s d
    k = key.view(b, s_k, n_heads, -1).permute(0, 2, 3, 1)  # b h d s
    v = value.view(b, s_k, n_heads, -1).permute(0, 2, 1, 3)  # b h s d
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(q.size(-1))
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        attn_weight = attn_weight + attn_bias[:, :, -s_q:, -s_k:]
    min_val = torch.finfo(q.dtype).min
    if is_causal and s_q > 1:
        causal_mask = attn_weight.new_ones(s_q, s_k, dtype=torch.float32).tril(s_k - s_q)
        causal_mask = causal_mask.to(torch.bool)
        attn_weight = attn_weight.masked_fill(~causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.to(v.dtype).matmul(v)
    return out.permute(0, 2, 1, 3).reshape(b, s_q, -1)


class MultiheadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d_model = config.d_model
        self.n_heads = config.n_heads
        self.qk_ln = config.attn_config["qk_ln"]
        self.softmax_scale = config.attn_config["softmax_scale"]
        if self.softmax_scale is None:
            self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model, bias=not config.no_bias)
        if self.qk_ln:
            self.q_ln = nn.LayerNorm(self.d_model)
            self.k_ln = nn.LayerNorm(self.d_model)
        self.out_proj = nn.Linear(self.d_model, self.d_model, bias=not config.no_bias)

    def forward(self, x, attn_bias=None, is_causal=True):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)
        if self.qk_ln:
            dtype = query.dtype
            query = self.q_ln(query).to(dtype)
            key = self.k_ln(key).to(dtype)
        context = scaled_multihead_dot_product_attention(
            query,
            key,
            value,
            self.n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            is_causal=is_causal,
        )
        return self.out_proj(context)


class MPTMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.expansion_ratio * config.d_model
        self.up_proj = nn.Linear(config.d_model, hidden, bias=not config.no_bias)
        self.down_proj = nn.Linear(hidden, config.d_model, bias=not config.no_bias)

    def forward(self, x):
        return self.down_proj(nn.functional.gelu(self.up_proj(x), approximate="none"))


class MPTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model)
        self.attn = MultiheadAttention(config)
        self.norm_2 = nn.LayerNorm(config.d_model)
        self.ffn = MPTMLP(config)

    def forward(self, x, attn_bias=None, is_causal=True):
        a = self.norm_1(x)
        b = self.attn(a, is_causal=is_causal)
        x = x + b
        m = self.norm_2(x)
        return x + self.ffn(m)


class SeaLionModel(nn.Module):
    """SEA-LION keeps MPT-7B's decoder: ALiBi instead of position embeddings."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.alibi = config.attn_config["alibi"]
        self.alibi_bias_max = config.attn_config["alibi_bias_max"]
        self.blocks = nn.ModuleList([MPTBlock(config)])
        self.norm_f = nn.LayerNorm(config.d_model)
        self.attn_bias = None
        self._attn_bias_initialized = False

    def _attn_bias(self, device, dtype):
        if not self._attn_bias_initialized or self.attn_bias.dtype != dtype:
            self.attn_bias = build_alibi_bias(
                self.config.n_heads,
                self.config.max_seq_len,
                full=self.config.attn_config["full_alibi"],
                alibi_bias_max=self.alibi_bias_max,
                device=device,
                dtype=dtype,
            )
            self._attn_bias_initialized = True
        return self.attn_bias

    def forward(self, inputs_embeds):
        attn_bias = self._attn_bias(inputs_embeds.device, inputs_embeds.dtype) if self.alibi else None
        x = inputs_embeds
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias, is_causal=True)
        return self.norm_f(x)


def make_sealion_model():
    torch.manual_seed(3517)
    model = SeaLionModel(SeaLionConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_sealion_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "blocks.0.attn",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": (
        "AI Singapore SEA-LION MultiheadAttention: one bug: MPTBlock receives the model's "
        "ALiBi attn_bias but calls self.attn without it"
    ),
}

