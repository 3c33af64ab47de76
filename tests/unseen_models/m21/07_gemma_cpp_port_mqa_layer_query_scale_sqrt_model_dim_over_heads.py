"""google/gemma.cpp (gemma/gemma-inl.h, weights.h) ported to torch for a tiny Gemma-1-style config.

Weights keep gemma.cpp's names and layouts: `embedder_input_embedding` (vocab, model_dim) scaled by
sqrt(model_dim) on lookup, `final_norm_scale`; per layer `layers.N` with `pre_attention_norm_scale`,
`pre_ffw_norm_scale` (RMSNorm with 1 + scale), `gating_einsum_w` (2, ff_hidden, model_dim) GeGLU and
`linear_w` (model_dim, ff_hidden), and the attention weights in `layers.N.attn`: `qkv_einsum_w`
(heads + 2*kv_heads, qkv_dim, model_dim) and `attn_vec_einsum_w` (heads, model_dim, qkv_dim), summed
over heads.  MQA: 4 query heads, 1 kv head, qkv_dim 24 (heads*qkv_dim 96 != model_dim 64).  Rope is
gemma.cpp's `Rope()` (x[i] with x[i + half], timescale 10000^(2i/qkv_dim)) at `pos`; then the queries
are multiplied by the layer's query scale, dot products with the cached keys, `Softmax` over
positions 0..pos, weighted sum of values.
Slip: every `LayerConfig` carries a `query_scale` type; layers 0 and 1 use
QueryScaleType::SqrtKeySize (1/sqrt(24)), layer 2 was configured with the Gemma-2 option
SqrtModelDimDivNumHeads, i.e. 1/sqrt(64/4) = 1/4.  No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "layers.2.attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "gemma.cpp port: qkv_einsum_w (h+2kv, qkv_dim, model_dim), attn_vec_einsum_w summed over heads, MQA 4/1, "
    "qkv_dim 24, halves Rope(), 1+scale RMSNorm, GeGLU gating_einsum_w; layer 2 query scale 1/sqrt(model_dim/heads)",
}


def RMSNormScaled(x, scale, eps=1e-6):
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * (1.0 + scale)


def Rope(x, pos):
    # x: (..., t, dim_qkv); pos: (t,)
    dim_qkv = x.shape[-1]
    half = dim_qkv // 2
    dims = torch.arange(half, dtype=torch.float64)
    freq_exponents = 2.0 * dims / dim_qkv
    timescale = torch.pow(10000.0, freq_exponents)
    theta = pos.to(torch.float64)[:, None] / timescale[None]
    cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


QUERY_SCALE = {
    "SqrtKeySize": lambda c: 1.0 / math.sqrt(c.qkv_dim),
    "SqrtModelDimDivNumHeads": lambda c: 1.0 / math.sqrt(c.model_dim // c.heads),
}


class Attention(nn.Module):
    def __init__(self, c, layer_config):
        super().__init__()
        self.heads, self.kv_heads, self.qkv_dim = c.heads, c.kv_heads, c.qkv_dim
        self.query_scale = QUERY_SCALE[layer_config.query_scale](c)
        self.qkv_einsum_w = nn.Parameter(torch.randn(c.heads + 2 * c.kv_heads, c.qkv_dim, c.model_dim) / math.sqrt(c.model_dim))
        self.attn_vec_einsum_w = nn.Parameter(torch.randn(c.heads, c.model_dim, c.qkv_dim) / math.sqrt(c.heads * c.qkv_dim))

    def forward(self, x):
        b, t, _ = x.shape
        qkv = torch.einsum("btm,nqm->bntq", x, self.qkv_einsum_w)
        q = qkv[:, : self.heads]
        k = qkv[:, self.heads : self.heads + self.kv_heads]
        v = qkv[:, self.heads + self.kv_heads :]
        pos = torch.arange(t, device=x.device)
        q = Rope(q, pos)
        k = Rope(k, pos)
        q = q * self.query_scale
        kv_for_head = torch.arange(self.heads) // (self.heads // self.kv_heads)
        logits = torch.einsum("bhtq,bhsq->bhts", q, k[:, kv_for_head])
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        att_out = torch.einsum("bhts,bhsq->bhtq", probs, v[:, kv_for_head])
        return torch.einsum("bhtq,hmq->btm", att_out, self.attn_vec_einsum_w)


class LayerWeights(nn.Module):
    def __init__(self, c, layer_config):
        super().__init__()
        self.pre_attention_norm_scale = nn.Parameter(torch.zeros(c.model_dim))
        self.attn = Attention(c, layer_config)
        self.pre_ffw_norm_scale = nn.Parameter(torch.zeros(c.model_dim))
        self.gating_einsum_w = nn.Parameter(torch.randn(2, c.ff_hidden_dim, c.model_dim) / math.sqrt(c.model_dim))
        self.linear_w = nn.Parameter(torch.randn(c.model_dim, c.ff_hidden_dim) / math.sqrt(c.ff_hidden_dim))

    def forward(self, x):
        x = x + self.attn(RMSNormScaled(x, self.pre_attention_norm_scale))
        h = RMSNormScaled(x, self.pre_ffw_norm_scale)
        gate = torch.einsum("btm,fm->btf", h, self.gating_einsum_w[0])
        up = torch.einsum("btm,fm->btf", h, self.gating_einsum_w[1])
        return x + torch.einsum("btf,mf->btm", F.gelu(gate, approximate="tanh") * up, self.linear_w)


class GemmaWeights(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embedder_input_embedding = nn.Parameter(torch.randn(c.vocab_size, c.model_dim) / math.sqrt(c.model_dim))
        self.layers = nn.ModuleList([LayerWeights(c, lc) for lc in c.layer_configs])
        self.final_norm_scale = nn.Parameter(torch.zeros(c.model_dim))

    def forward(self, tokens):
        x = self.embedder_input_embedding[tokens] * math.sqrt(self.c.model_dim)
        for layer in self.layers:
            x = layer(x)
        x = RMSNormScaled(x, self.final_norm_scale)
        return x @ self.embedder_input_embedding.t()


def make_model():
    torch.manual_seed(2107)
    c = SimpleNamespace(
        vocab_size=96, model_dim=64, ff_hidden_dim=128, heads=4, kv_heads=1, qkv_dim=24,
        layer_configs=[
            SimpleNamespace(query_scale="SqrtKeySize"),
            SimpleNamespace(query_scale="SqrtKeySize"),
            SimpleNamespace(query_scale="SqrtModelDimDivNumHeads"),
        ],
    )
    model = GemmaWeights(c)
    g = torch.Generator().manual_seed(21071)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm_scale"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()
