"""A decoder-only language model in the style of Harvard NLP's "The Annotated Transformer"
(written from memory, in my own words): `clones()` deep-copies a layer N times, `LayerNorm` is the
notebook's own (a_2 * (x - mean) / (std + eps) + b_2, with the *unbiased* std), `SublayerConnection`
applies the norm first (x + dropout(sublayer(norm(x)))), `MultiHeadedAttention` keeps its four
projections in one list `self.linears` (q, k, v, out) and calls the free function `attention()`,
which masks with `masked_fill(mask == 0, -1e9)`.  The causal mask comes from
`subsequent_mask(size)` (a triu of ones, compared with 0), `Embeddings` multiplies by sqrt(d_model),
and `PositionalEncoding` is the sin/cos interleaved table (even dims sin, odd dims cos).

Only the decoder half is kept (no source memory, no cross-attention): `decoder.layers.N.self_attn`,
3 layers, 4 heads of 16, d_model 64, vocab 120, `generator` is Linear + log_softmax.  No cache (the
notebook's greedy_decode re-runs the whole prefix).  Returns log-probabilities (batch, tokens, vocab).
"""

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "decoder.layers.0.self_attn",
        "decoder.layers.1.self_attn",
        "decoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Annotated Transformer: clones(), self.linears[0..3], attention() free function with masked_fill(mask == 0, -1e9), "
    "subsequent_mask, SublayerConnection pre-norm, a_2/b_2 LayerNorm with unbiased std, sin/cos interleaved PE",
}


def clones(module, N):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def subsequent_mask(size):
    attn_shape = (1, size, size)
    upper = torch.triu(torch.ones(attn_shape), diagonal=1).type(torch.uint8)
    return upper == 0


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # same mask for every head
        nbatches = query.size(0)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        ]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query, key, value
        return self.linears[-1](x)


class LayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(self.w_1(x).relu()))


class DecoderOnlyLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 2)

    def forward(self, x, tgt_mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        return self.sublayer[1](x, self.feed_forward)


class Decoder(nn.Module):
    def __init__(self, layer, N):
        super().__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, tgt_mask):
        for layer in self.layers:
            x = layer(x, tgt_mask)
        return self.norm(x)


class Embeddings(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout, max_len=256):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        x = x + self.pe[:, : x.size(1)].requires_grad_(False).to(x.dtype)
        return self.dropout(x)


class Generator(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        return F.log_softmax(self.proj(x), dim=-1)


class DecoderOnlyLM(nn.Module):
    def __init__(self, decoder, tgt_embed, generator):
        super().__init__()
        self.tgt_embed = tgt_embed
        self.decoder = decoder
        self.generator = generator

    def forward(self, tgt):
        tgt_mask = subsequent_mask(tgt.size(-1)).to(tgt.device)
        return self.generator(self.decoder(self.tgt_embed(tgt), tgt_mask))


def build_lm(vocab=120, N=3, d_model=64, d_ff=128, h=4, dropout=0.1):
    c = copy.deepcopy
    attn = MultiHeadedAttention(h, d_model)
    ff = PositionwiseFeedForward(d_model, d_ff, dropout)
    position = PositionalEncoding(d_model, dropout)
    model = DecoderOnlyLM(
        Decoder(DecoderOnlyLayer(d_model, c(attn), c(ff), dropout), N),
        nn.Sequential(Embeddings(d_model, vocab), c(position)),
        Generator(d_model, vocab),
    )
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


def make_model():
    torch.manual_seed(6101)
    model = build_lm()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.a_2.copy_(1.0 + 0.3 * torch.randn_like(m.a_2))
                m.b_2.copy_(0.1 * torch.randn_like(m.b_2))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()
