"""MosaicML MPT (llm-foundry, attn_impl='torch'): Wqkv chunked into q | k | v, einops rearranges,
scaled_multihead_dot_product_attention with softmax_scale; the model precomputes an ALiBi bias with
gen_slopes(alibi_bias_max=8) for 12 heads (rounded up to 16 and interleaved) over key positions
1-seq_len..0, the attention slices it, adds it after the scale and then applies the tril causal mask."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
from einops import rearrange


def gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        # in the case where n_heads is not a power of two, take every other slope first
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
    query,
    key,
    value,
    n_heads,
    softmax_scale=None,
    attn_bias=None,
    is_causal=False,
    dropout_p=0.0,
    training=False,
):
    q = rearrange(query, "b s (h d) -> b h s d", h=n_heads)
    k = rearrange(key, "b s (h d) -> b h d s", h=n_heads)
    v = rearrange(value, "b s (h d) -> b h s d", h=n_heads)
    b, _, s_q, d = q.shape
    s_k = k.size(-1)
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        _s_q = max(0, attn_bias.size(2) - s_q)
        _s_k = max(0, attn_bias.size(3) - s_k)
        attn_bias = attn_bias[:, :, _s_q:, _s_k:]
        attn_weight = attn_weight + attn_bias
    min_val = torch.finfo(q.dtype).min
    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float16)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    if dropout_p:
        attn_weight = torch.nn.functional.dropout(
            attn_weight, p=dropout_p, training=training, inplace=True
        )
    out = attn_weight.to(v.dtype).matmul(v)
    out = rearrange(out, "b h s d -> b s (h d)")
    return out, attn_weight


class MultiheadAttention(nn.Module):
    """Multi-head self attention with the torch implementation of the attention core."""

    def __init__(self, d_model, n_heads, softmax_scale=None, attn_pdrop=0.0):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.softmax_scale = softmax_scale
        if self.softmax_scale is None:
            self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.attn_dropout_p = attn_pdrop
        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model, bias=False)
        self.attn_fn = scaled_multihead_dot_product_attention
        self.out_proj = nn.Linear(self.d_model, self.d_model, bias=False)

    def forward(self, x, attn_bias=None, is_causal=True):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)
        context, attn_weights = self.attn_fn(
            query,
            key,
            value,
            self.n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            is_causal=is_causal,
            dropout_p=self.attn_dropout_p,
            training=self.training,
        )
        return self.out_proj(context), attn_weights


class MPTMLP(nn.Module):
    def __init__(self, d_model, expansion_ratio):
        super().__init__()
        self.up_proj = nn.Linear(d_model, expansion_ratio * d_model, bias=False)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(expansion_ratio * d_model, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class MPTBlock(nn.Module):
    def __init__(self, d_model, n_heads, expansion_ratio):
        super().__init__()
        self.norm_1 = nn.LayerNorm(d_model, bias=False)
        self.attn = MultiheadAttention(d_model=d_model, n_heads=n_heads)
        self.norm_2 = nn.LayerNorm(d_model, bias=False)
        self.ffn = MPTMLP(d_model=d_model, expansion_ratio=expansion_ratio)

    def forward(self, x, attn_bias=None, is_causal=True):
        a = self.norm_1(x)
        b, _ = self.attn(a, attn_bias=attn_bias, is_causal=is_causal)
        x = x + b
        m = self.norm_2(x)
        return x + self.ffn(m)


class MPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.alibi = config.attn_config["alibi"]
        self.alibi_bias_max = config.attn_config["alibi_bias_max"]
        self.is_causal = True
        self.blocks = nn.ModuleList(
            [
                MPTBlock(config.d_model, config.n_heads, config.expansion_ratio)
                for _ in range(config.n_layers)
            ]
        )
        self.norm_f = nn.LayerNorm(config.d_model, bias=False)
        self.attn_bias_shape = (1, config.n_heads, 1, config.max_seq_len) if self.alibi else None
        self._attn_bias_initialized = False
        self.attn_bias = None

    @torch.no_grad()
    def _attn_bias(self, device, dtype):
        if not self._attn_bias_initialized or self.attn_bias.dtype != dtype:
            if self.attn_bias_shape:
                self.attn_bias = torch.zeros(self.attn_bias_shape, device=device, dtype=dtype)
                self.attn_bias = self.attn_bias + build_alibi_bias(
                    self.config.n_heads,
                    self.config.max_seq_len,
                    full=False,
                    alibi_bias_max=self.alibi_bias_max,
                    device=device,
                    dtype=dtype,
                )
            self._attn_bias_initialized = True
        return self.attn_bias

    def forward(self, inputs_embeds):
        S = inputs_embeds.size(1)
        assert S <= self.config.max_seq_len
        attn_bias = self._attn_bias(device=inputs_embeds.device, dtype=inputs_embeds.dtype)
        x = inputs_embeds
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias, is_causal=self.is_causal)
        return self.norm_f(x)


def make_model():
    config = SimpleNamespace(
        d_model=96,
        n_heads=12,
        n_layers=1,
        expansion_ratio=2,
        max_seq_len=64,
        attn_config={"attn_impl": "torch", "alibi": True, "alibi_bias_max": 8, "qk_ln": False},
    )
    return MPTModel(config)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "structure": {
        "heads": 12,
        "kv_heads": 12,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "alibi",
    },
    "style": "MosaicML MPT (Wqkv.chunk(3), einops 'b s (h d) -> b h d s', model-level attn_bias from gen_slopes/build_alibi_bias with 12 heads, sliced and added after softmax_scale, tril causal mask)",
}
