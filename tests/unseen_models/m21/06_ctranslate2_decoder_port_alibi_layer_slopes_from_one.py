"""OpenNMT/CTranslate2 TransformerDecoder (layers/transformer.cc, layers/attention.cc) ported to torch,
for a model converted from an ALiBi checkpoint (MPT-style: no position embeddings).

Module tree after the converter's spec names: decoder (embeddings, layer.N, layer_norm, projection);
TransformerDecoderLayer: self_attention, self_attention_layer_norm (the spec keeps it under
self_attention; here the layer holds it), ffn (layer_norm, linear_0, linear_1).  MultiHeadAttention:
`linear` = [fused qkv (bias-free, q|k|v along the output), output projection], split_heads to
(b, h, t, d), queries multiplied by queries_scale 1/sqrt(d) before the matmul, then the `Alibi` layer
adds slope * (key_pos - query_pos) to the scores, the causal mask fills the lowest value, softmax,
combine_heads, output projection.  Slopes from the standard power-of-two recipe (4 heads: 2^-2 ... 2^-8).
Slip: each decoder layer owns its `Alibi` (the converter emits one per layer); layer 2's was built
by an old helper that counts exponents from 0, so its slopes are 2^0, 2^-2, 2^-4, 2^-6.  No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.layer.0.self_attention",
        "decoder.layer.1.self_attention",
        "decoder.layer.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "decoder.layer.2.self_attention",
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "style": "CTranslate2 decoder port: fused bias-free qkv in `linear[0]`, queries_scale before matmul, per-layer "
    "Alibi layer adding slope*(k-q), lowest-value causal mask; layer 2's Alibi slopes start at 2^0",
}


def get_slopes(num_heads):
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-4.0 / closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return slopes


def get_slopes_legacy(num_heads):
    base = 2.0 ** (-8.0 / num_heads)
    return [base ** i for i in range(num_heads)]


class Alibi(nn.Module):
    def __init__(self, num_heads, legacy=False):
        super().__init__()
        self.num_heads = num_heads
        self.legacy = legacy

    def forward(self, scores):
        # scores: (b, h, q, k); queries are the last q of the k positions
        q_len, k_len = scores.shape[-2], scores.shape[-1]
        slopes = get_slopes_legacy(self.num_heads) if self.legacy else get_slopes(self.num_heads)
        slopes = torch.tensor(slopes, dtype=torch.float64)
        qpos = torch.arange(k_len - q_len, k_len, dtype=torch.float64)[:, None]
        kpos = torch.arange(k_len, dtype=torch.float64)[None, :]
        alibi = slopes[:, None, None] * (kpos - qpos)[None]
        return scores + alibi.to(scores.dtype)[None]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, alibi):
        super().__init__()
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        self.queries_scale = 1.0 / math.sqrt(self.d_head)
        self.linear = nn.ModuleList([nn.Linear(d_model, 3 * d_model, bias=False), nn.Linear(d_model, d_model, bias=False)])
        self.alibi = alibi

    def split_heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.d_head).transpose(1, 2)

    def combine_heads(self, x):
        b, h, t, d = x.shape
        return x.transpose(1, 2).reshape(b, t, h * d)

    def forward(self, queries):
        fused = self.linear[0](queries)
        q, k, v = fused.split(fused.shape[-1] // 3, dim=-1)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        q = q * self.queries_scale
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = self.alibi(scores)
        t = scores.shape[-1]
        future = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        attn = F.softmax(scores, dim=-1)
        context = torch.matmul(attn, v)
        return self.linear[1](self.combine_heads(context))


class FeedForwardNetwork(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.layer_norm = nn.LayerNorm(d_model)
        self.linear_0 = nn.Linear(d_model, d_ff, bias=False)
        self.linear_1 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return x + self.linear_1(F.gelu(self.linear_0(self.layer_norm(x))))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, cfg, legacy_alibi):
        super().__init__()
        self.self_attention_layer_norm = nn.LayerNorm(cfg.d_model)
        self.self_attention = MultiHeadAttention(cfg.d_model, cfg.num_heads, Alibi(cfg.num_heads, legacy=legacy_alibi))
        self.ffn = FeedForwardNetwork(cfg.d_model, cfg.d_ff)

    def forward(self, x):
        x = x + self.self_attention(self.self_attention_layer_norm(x))
        return self.ffn(x)


class TransformerDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layer = nn.ModuleList(
            [TransformerDecoderLayer(cfg, legacy_alibi=(i in cfg.legacy_alibi_layers)) for i in range(cfg.num_layers)]
        )
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.projection = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, ids):
        x = self.embeddings(ids)
        for layer in self.layer:
            x = layer(x)
        return self.projection(self.layer_norm(x))


class TransformerDecoderModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.decoder = TransformerDecoder(cfg)

    def forward(self, ids):
        return self.decoder(ids)


def make_model():
    torch.manual_seed(2106)
    cfg = SimpleNamespace(vocab_size=96, d_model=64, d_ff=128, num_heads=4, num_layers=3, legacy_alibi_layers=[2])
    model = TransformerDecoderModel(cfg)
    g = torch.Generator().manual_seed(21061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
