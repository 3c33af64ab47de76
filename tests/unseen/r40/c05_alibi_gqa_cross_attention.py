"""From-scratch ALiBi + grouped-query attention encoder-decoder (Taeksu-Kim/alibi_gqa_transformer, whose attention follows llm-foundry's torch path): fused-free Wq/Wk/Wv with biases, rearrange to heads, repeat_kv for GQA, ALiBi bias built once by the model (gen_slopes with alibi_bias_max=8, key-offset row for causal, -|i-j| for the bidirectional encoder), finfo.min causal fill, pre-norm.

This file: correct: decoder cross-attention sub-layer, GQA 4:2, queries from the decoder stream, Wk/Wv on the encoder output, no bias, no mask."""

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


class AlibiGQAConfig:
    d_model = 64
    q_n_heads = 4
    kv_n_heads = 2
    feed_forward_dim = 128
    alibi_bias_max = 8
    attn_impl = "torch"  # "torch" (eager) or "sdpa"
    sliding_window = None  # keys a query may see, itself included (None: full causal)
    prefix_len = None


def gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float64, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full=False, alibi_bias_max=8, device=None, dtype=None):
    # causal: one row of key offsets (1-s .. 0) broadcast over queries; full: -|i - j|
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.float64, device=device).view(
        1, 1, 1, seq_len
    )
    if full:
        alibi_bias = alibi_bias - torch.arange(
            1 - seq_len, 1, dtype=torch.float64, device=device
        ).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)
    slopes = gen_slopes(n_heads, alibi_bias_max, device=device)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def repeat_kv(x, n_rep):
    """torch.repeat_interleave(x, dim=1, repeats=n_rep) without the copy."""
    bs, n_kv_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, None, :, :]
        .expand(bs, n_kv_heads, n_rep, slen, head_dim)
        .reshape(bs, n_kv_heads * n_rep, slen, head_dim)
    )


def scaled_multihead_dot_product_attention(
    query, key, value, q_n_heads, kv_n_heads, attn_bias=None, is_causal=False
):
    q = rearrange(query, "b s (h d) -> b h s d", h=q_n_heads)
    k = rearrange(key, "b s (h d) -> b h s d", h=kv_n_heads)
    v = rearrange(value, "b s (h d) -> b h s d", h=kv_n_heads)
    if q_n_heads != kv_n_heads:
        k = repeat_kv(k, q_n_heads // kv_n_heads)
        v = repeat_kv(v, q_n_heads // kv_n_heads)

    b, _, s_q, d = q.shape
    s_k = k.size(2)
    softmax_scale = 1 / math.sqrt(d)
    attn_weight = q.matmul(k.transpose(-1, -2)) * softmax_scale
    if attn_bias is not None:
        attn_bias = attn_bias[:, :, -s_q:, -s_k:]
        attn_weight = attn_weight + attn_bias
    min_val = torch.finfo(q.dtype).min
    if is_causal and s_q != 1:
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.bool).tril()
        causal_mask = ~causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.to(v.dtype).matmul(v)
    return rearrange(out, "b h s d -> b s (h d)")


def sdpa_attention(query, key, value, q_n_heads, kv_n_heads, attn_bias=None, is_causal=False):
    q = rearrange(query, "b s (h d) -> b h s d", h=q_n_heads)
    k = rearrange(key, "b s (h d) -> b h s d", h=kv_n_heads)
    v = rearrange(value, "b s (h d) -> b h s d", h=kv_n_heads)
    if q_n_heads != kv_n_heads:
        k = repeat_kv(k, q_n_heads // kv_n_heads)
        v = repeat_kv(v, q_n_heads // kv_n_heads)
    s_q, s_k = q.size(2), k.size(2)
    mask = None
    if attn_bias is not None:
        # SDPA cannot take is_causal together with an additive bias: fold the causal part in
        mask = attn_bias[:, :, -s_q:, -s_k:].expand(q.size(0), -1, s_q, s_k)
        if is_causal:
            future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(s_k - s_q + 1)
            mask = mask.masked_fill(future, torch.finfo(q.dtype).min)
        is_causal = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return rearrange(out, "b h s d -> b s (h d)")


class MultiheadAttention(nn.Module):
    def __init__(self, d_model, q_n_heads, kv_n_heads, attn_impl="torch"):
        super().__init__()
        self.d_model = d_model
        self.head_dim = d_model // q_n_heads
        self.q_n_heads = q_n_heads
        self.kv_n_heads = kv_n_heads
        self.Wq = nn.Linear(d_model, d_model)
        self.Wk = nn.Linear(d_model, self.head_dim * kv_n_heads)
        self.Wv = nn.Linear(d_model, self.head_dim * kv_n_heads)
        self.attn_fn = (
            sdpa_attention if attn_impl == "sdpa" else scaled_multihead_dot_product_attention
        )
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, q, kv, attn_bias=None, is_causal=True):
        query = self.Wq(q)
        key = self.Wk(kv)
        value = self.Wv(kv)
        context = self.attn_fn(
            query,
            key,
            value,
            self.q_n_heads,
            self.kv_n_heads,
            attn_bias=attn_bias,
            is_causal=is_causal,
        )
        return self.out_proj(context)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.feed_forward_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.feed_forward_dim, bias=False)
        self.down_proj = nn.Linear(config.feed_forward_dim, config.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config, is_causal):
        super().__init__()
        self.is_causal = is_causal
        self.norm_1 = nn.LayerNorm(config.d_model)
        self.self_attn = MultiheadAttention(
            config.d_model, config.q_n_heads, config.kv_n_heads, config.attn_impl
        )
        self.norm_2 = nn.LayerNorm(config.d_model)
        self.ffn = LlamaMLP(config)

    def forward(self, x, attn_bias=None):
        a = self.norm_1(x)
        x = x + self.self_attn(a, a, attn_bias=attn_bias, is_causal=self.is_causal)
        return x + self.ffn(self.norm_2(x))


class AlibiTransformer(nn.Module):
    """Stack of pre-norm layers; the model builds one ALiBi bias (plus the band of a sliding
    window) and hands it to every layer."""

    def __init__(self, config, is_causal=True):
        super().__init__()
        self.config = config
        self.is_causal = is_causal
        self.layers = nn.ModuleList([TransformerLayer(config, is_causal)])
        self.norm_f = nn.LayerNorm(config.d_model)

    def build_attn_bias(self, seq_len, device, dtype):
        c = self.config
        attn_bias = torch.zeros(1, c.q_n_heads, 1, seq_len, device=device, dtype=dtype)
        attn_bias = attn_bias.add(
            build_alibi_bias(
                c.q_n_heads,
                seq_len,
                full=not self.is_causal,
                alibi_bias_max=c.alibi_bias_max,
                device=device,
                dtype=dtype,
            )
        )
        if c.sliding_window is not None:
            pos = torch.arange(seq_len, device=device)
            delta = pos[:, None] - pos[None, :]
            outside = delta >= c.sliding_window
            attn_bias = attn_bias.expand(1, c.q_n_heads, seq_len, seq_len)
            attn_bias = attn_bias.masked_fill(outside, torch.finfo(dtype).min)
        return attn_bias

    def forward(self, x):
        attn_bias = self.build_attn_bias(x.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, attn_bias=attn_bias)
        return self.norm_f(x)


class CrossAttentionBlock(nn.Module):
    """Decoder cross-attention sub-layer: queries from the decoder stream, keys and values from
    the encoder output (no position bias across the two sequences)."""

    def __init__(self, config):
        super().__init__()
        self.norm_q = nn.LayerNorm(config.d_model)
        self.cross_attn = MultiheadAttention(
            config.d_model, config.q_n_heads, config.kv_n_heads, config.attn_impl
        )

    def forward(self, hidden, context):
        a = self.norm_q(hidden)
        return hidden + self.cross_attn(a, context, attn_bias=None, is_causal=False)


def _init(model, seed):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


def make_alibi_cross_block():
    torch.manual_seed(4005)
    model = CrossAttentionBlock(AlibiGQAConfig())
    return _init(model, 4005)


EXPECT = {
    "target": "make_alibi_cross_block",
    "kind": "cross",
    "ok": True,
    "layer": "cross_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "ALiBi GQA (c05_alibi_gqa_cross_attention): correct: decoder cross-attention sub-layer, "
    "GQA 4:2, queries from the decoder stream, Wk/Wv on the encoder output, no bias, no mask",
}
