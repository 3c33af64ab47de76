"""A tiny MPT in the style of MosaicML llm-foundry (models/mpt/modeling_mpt.py, layers/attention.py).

MPTForCausalLM -> transformer (wte, blocks ModuleList of MPTBlock(norm_1, attn, norm_2, ffn),
norm_f) with the output tied to wte.  no_bias everywhere (LayerNorm without bias), fused Wqkv
split into thirds, 8 heads, ALiBi built once by the model (build_alibi_bias: key offsets
arange(1 - S, 1) times gen_slopes(8, alibi_bias_max=8) = 2^-1 ... 2^-8) and passed to every
block as attn_bias.  The 'torch' attention implementation (scaled_multihead_dot_product_attention)
adds attn_bias to the scaled scores, then fills the causal positions with finfo.min.

block_overrides puts layer 1 on the 'sdpa' implementation (a faster path this fork added).

Slip: the sdpa implementation calls F.scaled_dot_product_attention(..., is_causal=True) and
never passes attn_bias, so transformer.blocks.1.attn runs without the ALiBi bias.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.blocks.0.attn",
        "transformer.blocks.1.attn",
        "transformer.blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.blocks.1.attn",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "llm-foundry MPT: fused Wqkv, model-level ALiBi attn_bias (gen_slopes), scaled_multihead_dot_product_attention, "
    "block_overrides; slip: the overridden 'sdpa' attn_impl drops attn_bias",
}


@dataclass
class MPTConfig:
    d_model: int = 64
    n_heads: int = 8
    n_layers: int = 3
    expansion_ratio: int = 4
    max_seq_len: int = 64
    vocab_size: int = 128
    attn_config: dict = field(
        default_factory=lambda: {"attn_impl": "torch", "alibi": True, "alibi_bias_max": 8}
    )
    block_overrides: dict = field(default_factory=lambda: {1: {"attn_impl": "sdpa"}})


def gen_slopes(n_heads, alibi_bias_max=8):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, alibi_bias_max=8, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32).view(1, 1, 1, seq_len)
    slopes = gen_slopes(n_heads, alibi_bias_max)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def scaled_multihead_dot_product_attention(
    query, key, value, n_heads, softmax_scale, attn_bias=None, is_causal=True
):
    b, s_q, _ = query.shape
    s_k = key.shape[1]
    q = query.view(b, s_q, n_heads, -1).permute(0, 2, 1, 3)  # b h s d
    k = key.view(b, s_k, n_heads, -1).permute(0, 2, 3, 1)  # b h d s
    v = value.view(b, s_k, n_heads, -1).permute(0, 2, 1, 3)  # b h s d
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        _s_q = max(0, attn_bias.size(2) - s_q)
        _s_k = max(0, attn_bias.size(3) - s_k)
        attn_bias = attn_bias[:, :, _s_q:, _s_k:]
        attn_weight = attn_weight + attn_bias
    min_val = torch.finfo(q.dtype).min
    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float32)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.matmul(v)
    return out.permute(0, 2, 1, 3).reshape(b, s_q, -1)


def sdpa_attention(query, key, value, n_heads, softmax_scale, attn_bias=None, is_causal=True):
    b, s_q, _ = query.shape
    s_k = key.shape[1]
    q = query.view(b, s_q, n_heads, -1).transpose(1, 2)
    k = key.view(b, s_k, n_heads, -1).transpose(1, 2)
    v = value.view(b, s_k, n_heads, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal and s_q > 1, scale=softmax_scale
    )
    return out.transpose(1, 2).reshape(b, s_q, -1)


ATTN_IMPLS = {"torch": scaled_multihead_dot_product_attention, "sdpa": sdpa_attention}


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_model, n_heads, attn_impl="torch"):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.attn_impl = attn_impl
        self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model, bias=False)
        self.out_proj = nn.Linear(self.d_model, self.d_model, bias=False)
        self.attn_fn = ATTN_IMPLS[attn_impl]

    def forward(self, x, attn_bias=None, is_causal=True):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)
        context = self.attn_fn(
            query,
            key,
            value,
            self.n_heads,
            self.softmax_scale,
            attn_bias=attn_bias,
            is_causal=is_causal,
        )
        return self.out_proj(context)


class MPTMLP(nn.Module):
    def __init__(self, d_model, expansion_ratio):
        super().__init__()
        self.up_proj = nn.Linear(d_model, expansion_ratio * d_model, bias=False)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(expansion_ratio * d_model, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class MPTBlock(nn.Module):
    def __init__(self, config, attn_impl):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model, bias=False)
        self.attn = GroupedQueryAttention(config.d_model, config.n_heads, attn_impl=attn_impl)
        self.norm_2 = nn.LayerNorm(config.d_model, bias=False)
        self.ffn = MPTMLP(config.d_model, config.expansion_ratio)

    def forward(self, x, attn_bias=None, is_causal=True):
        a = self.norm_1(x)
        x = x + self.attn(a, attn_bias=attn_bias, is_causal=is_causal)
        m = self.norm_2(x)
        return x + self.ffn(m)


class MPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        blocks = []
        for i in range(config.n_layers):
            impl = config.block_overrides.get(i, {}).get(
                "attn_impl", config.attn_config["attn_impl"]
            )
            blocks.append(MPTBlock(config, impl))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = nn.LayerNorm(config.d_model, bias=False)
        self._attn_bias_initialized = False
        self.attn_bias = None

    def _attn_bias(self, dtype):
        if not self._attn_bias_initialized or self.attn_bias.dtype != dtype:
            self.attn_bias = build_alibi_bias(
                self.config.n_heads,
                self.config.max_seq_len,
                alibi_bias_max=self.config.attn_config["alibi_bias_max"],
                dtype=dtype,
            )
            self._attn_bias_initialized = True
        return self.attn_bias

    def forward(self, input_ids):
        S = input_ids.size(1)
        x = self.wte(input_ids)
        attn_bias = self._attn_bias(x.dtype)[:, :, :, -S:]
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias, is_causal=True)
        return self.norm_f(x)


class MPTForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = MPTModel(config)

    def forward(self, input_ids):
        outputs = self.transformer(input_ids)
        return F.linear(outputs, self.transformer.wte.weight)


def make_model():
    torch.manual_seed(1010)
    model = MPTForCausalLM(MPTConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()
