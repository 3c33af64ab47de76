"""MPT/llm-foundry-style block (Wqkv, ALiBi attn_bias built once by the model, 8 heads); bug: gen_slopes uses
torch.arange(n_heads) instead of arange(1, n_heads + 1), so the slopes are 2**0, 2**-1, ... (first head slope 1)."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


def gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(_n_heads, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full=False, alibi_bias_max=8, device=None, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(
        1, 1, 1, seq_len
    )
    if full:
        alibi_bias = alibi_bias - torch.arange(
            1 - seq_len, 1, dtype=torch.int32, device=device
        ).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)
    slopes = gen_slopes(n_heads, alibi_bias_max, device=device)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def scaled_multihead_dot_product_attention(
    query, key, value, n_heads, softmax_scale=None, attn_bias=None, is_causal=False
):
    q = rearrange(query, "b s (h d) -> b h s d", h=n_heads)
    k = rearrange(key, "b s (h d) -> b h d s", h=n_heads)
    v = rearrange(value, "b s (h d) -> b h s d", h=n_heads)
    min_val = torch.finfo(q.dtype).min
    b, _, s_q, d = q.shape
    s_k = k.size(-1)
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        attn_bias = attn_bias[:, :, -s_q:, -s_k:]
        attn_weight = attn_weight + attn_bias
    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float16)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.matmul(v)
    out = rearrange(out, "b h s d -> b s (h d)")
    return out, attn_weight


class MultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads, softmax_scale=None):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.softmax_scale = softmax_scale
        if self.softmax_scale is None:
            self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model)
        self.out_proj = nn.Linear(self.d_model, self.d_model)

    def forward(self, x, attn_bias=None, is_causal=True):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)
        context, attn_weights = scaled_multihead_dot_product_attention(
            query,
            key,
            value,
            self.n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            is_causal=is_causal,
        )
        return self.out_proj(context), attn_weights


class MPTBlock(nn.Module):
    def __init__(self, d_model, n_heads, expansion_ratio=4):
        super().__init__()
        self.norm_1 = nn.LayerNorm(d_model)
        self.attn = MultiheadAttention(d_model, n_heads)
        self.norm_2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, expansion_ratio * d_model),
            nn.GELU(approximate="none"),
            nn.Linear(expansion_ratio * d_model, d_model),
        )

    def forward(self, x, attn_bias=None):
        b, _ = self.attn(self.norm_1(x), attn_bias=attn_bias, is_causal=True)
        x = x + b
        return x + self.ffn(self.norm_2(x))


class MPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            [MPTBlock(config.d_model, config.n_heads) for _ in range(config.n_layers)]
        )
        self.norm_f = nn.LayerNorm(config.d_model)
        self._attn_bias_initialized = False
        self.attn_bias = None

    def _attn_bias(self, device, dtype):
        if not self._attn_bias_initialized or self.attn_bias.dtype != dtype:
            self.attn_bias = build_alibi_bias(
                self.config.n_heads,
                self.config.max_seq_len,
                full=not self.config.causal,
                alibi_bias_max=self.config.alibi_bias_max,
                device=device,
                dtype=dtype,
            )
            self._attn_bias_initialized = True
        return self.attn_bias

    def forward(self, inputs_embeds):
        attn_bias = self._attn_bias(inputs_embeds.device, inputs_embeds.dtype)
        x = inputs_embeds
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias)
        return self.norm_f(x)


def make_mpt():
    return MPTModel(
        SimpleNamespace(
            d_model=64, n_heads=8, n_layers=1, max_seq_len=256, alibi_bias_max=8, causal=True
        )
    )


EXPECT = {
    "target": "make_mpt",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "layer": "blocks.0.attn",
    "style": "MPT / llm-foundry (Wqkv.chunk(3), scaled_multihead_dot_product_attention with einops 'b s (h d) -> b h d s', build_alibi_bias key-position form arange(1 - s, 1), softmax_scale); gen_slopes starts m at 0",
}
