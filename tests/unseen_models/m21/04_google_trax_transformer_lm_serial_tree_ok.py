"""google/trax models/transformer.py TransformerLM ported to torch keeping the combinator tree.

Trax builds the LM as one Serial: ShiftRight(mode), Embedding, Dropout, PositionalEncoding,
n_layers x DecoderBlock, LayerNorm, Dense(vocab), LogSoftmax.  Each DecoderBlock is a Serial of two
Residuals: Residual(LayerNorm, CausalAttention, Dropout) and Residual(LayerNorm, Dense(d_ff), Relu,
Dropout, Dense(d_model), Dropout).  The tree is kept as nested `sublayers` ModuleLists, so the
attention layers sit at `sublayers.4.sublayers.0.sublayers.1` and so on.  Dense holds Trax-layout
weights `w` (in, out) and bias `b`.  CausalAttention: Dense q/k/v (sublayers 0..2), heads split
(b, t, h, d) -> (b, h, t, d), DotProductCausalAttention (dots / sqrt(depth), jnp.where(mask, dots,
-1e9), exp(dots - logsumexp)), heads merged, Dense out (sublayer 3).  Sinusoidal PositionalEncoding
with sin at even and cos at odd features.  ShiftRight in 'eval' mode pads one 0 on the left, so the
output at t predicts token t from tokens < t; the model returns log-probabilities.  No cache; correct.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "sublayers.4.sublayers.0.sublayers.1",
        "sublayers.5.sublayers.0.sublayers.1",
        "sublayers.6.sublayers.0.sublayers.1",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "style": "trax TransformerLM as nested Serial/Residual sublayers: ShiftRight, sinusoidal PositionalEncoding, "
    "Dense w (in, out) q/k/v/out, DotProductCausalAttention with -1e9 where-mask and exp(x - logsumexp), LogSoftmax",
}


class Serial(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.sublayers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.sublayers:
            x = layer(x)
        return x


class Residual(Serial):
    def forward(self, x):
        return x + super().forward(x)


class Dense(nn.Module):
    def __init__(self, n_in, n_units):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_in, n_units) / math.sqrt(n_in))
        self.b = nn.Parameter(0.02 * torch.randn(n_units))

    def forward(self, x):
        return torch.matmul(x, self.w) + self.b


class LayerNorm(nn.Module):
    def __init__(self, d, epsilon=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.epsilon = epsilon

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        variance = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(variance + self.epsilon) * self.scale + self.bias


class ShiftRight(nn.Module):
    def __init__(self, n_positions=1, mode="eval"):
        super().__init__()
        self.n_positions = n_positions
        self.mode = mode

    def forward(self, x):
        if self.mode == "predict":
            return x
        pad = torch.zeros(x.shape[0], self.n_positions, dtype=x.dtype, device=x.device)
        return torch.cat([pad, x], dim=1)[:, : x.shape[1]]


class Embedding(nn.Module):
    def __init__(self, vocab_size, d_feature):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(vocab_size, d_feature))

    def forward(self, x):
        return self.weights[x]


class PositionalEncoding(nn.Module):
    def __init__(self, max_len=64, d_feature=64):
        super().__init__()
        self.max_len = max_len
        self.d_feature = d_feature

    def forward(self, x):
        pos = torch.arange(self.max_len, dtype=torch.float64)[:, None]
        div_term = torch.exp(torch.arange(0, self.d_feature, 2, dtype=torch.float64) * -(math.log(10000.0) / self.d_feature))
        pe = torch.zeros(self.max_len, self.d_feature, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * div_term)
        pe[:, 1::2] = torch.cos(pos * div_term)
        return x + pe[None, : x.shape[1]].to(x.dtype)


class Relu(nn.Module):
    def forward(self, x):
        return torch.clamp(x, min=0)


class LogSoftmax(nn.Module):
    def forward(self, x):
        return x - torch.logsumexp(x, dim=-1, keepdim=True)


def DotProductCausalAttention(queries, keys, values):
    depth = queries.shape[-1]
    dots = torch.matmul(queries, keys.transpose(-1, -2)) / math.sqrt(depth)
    n_q, n_k = dots.shape[-2], dots.shape[-1]
    mask = torch.tril(torch.ones(n_q, n_k, dtype=torch.bool, device=dots.device), diagonal=n_k - n_q)
    dots = torch.where(mask, dots, torch.full_like(dots, -1e9))
    dots = torch.exp(dots - torch.logsumexp(dots, dim=-1, keepdim=True))
    return torch.matmul(dots, values)


class CausalAttention(nn.Module):
    def __init__(self, d_feature, n_heads=1):
        super().__init__()
        self.n_heads = n_heads
        self.sublayers = nn.ModuleList([Dense(d_feature, d_feature) for _ in range(4)])

    def forward(self, x):
        b, t, d = x.shape
        h = self.n_heads

        def split_heads(y):
            return y.reshape(b, t, h, d // h).transpose(1, 2)

        q = split_heads(self.sublayers[0](x))
        k = split_heads(self.sublayers[1](x))
        v = split_heads(self.sublayers[2](x))
        out = DotProductCausalAttention(q, k, v)
        out = out.transpose(1, 2).reshape(b, t, d)
        return self.sublayers[3](out)


def DecoderBlock(d_model, d_ff, n_heads, dropout):
    return Serial(
        Residual(LayerNorm(d_model), CausalAttention(d_model, n_heads=n_heads), nn.Dropout(dropout)),
        Residual(
            LayerNorm(d_model), Dense(d_model, d_ff), Relu(), nn.Dropout(dropout),
            Dense(d_ff, d_model), nn.Dropout(dropout),
        ),
    )


class TransformerLM(Serial):
    def __init__(self, vocab_size=96, d_model=64, d_ff=128, n_layers=3, n_heads=4, max_len=64, dropout=0.1, mode="eval"):
        super().__init__(
            ShiftRight(mode=mode),
            Embedding(vocab_size, d_model),
            nn.Dropout(dropout),
            PositionalEncoding(max_len, d_model),
            *[DecoderBlock(d_model, d_ff, n_heads, dropout) for _ in range(n_layers)],
            LayerNorm(d_model),
            Dense(d_model, vocab_size),
            LogSoftmax(),
        )


def make_model():
    torch.manual_seed(2104)
    model = TransformerLM()
    g = torch.Generator().manual_seed(21041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
