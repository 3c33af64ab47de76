"""labml.ai annotated paper implementations: the RoPE experiment's AutoregressiveTransformer
(labml_nn/transformers/rope + mha.py + models.py), plain torch, sequence-first inside.

AutoregressiveTransformer: src_embed (nn.Embedding, no absolute positions), encoder (Encoder:
layers = clone_module_list of TransformerLayer, norm), generator (Linear).  labml works on
[seq_len, batch]; this port's forward takes (batch, seq), transposes to labml's layout and transposes
the logits back.  TransformerLayer is pre-LN: norm_self_attn -> self_attn(query=z, key=z, value=z,
mask=mask) -> + x -> norm_ff -> feed_forward (layer1/ReLU/layer2) -> + x.
RotaryPEMultiHeadAttention: query/key/value are PrepareForMultiHeadAttention (`linear` with bias,
viewed [seq, batch, heads, d_k]), separate query_rotary_pe / key_rotary_pe (RotaryPositionalEmbeddings
on the first rope_percentage = 0.5 of each head, halves layout: cat(-x[d/2:], x[:d/2]), base 1e4),
scores einsum('ibhd,jbhd->ijbh') * scale, masked_fill(mask == 0, -inf) with the subsequent_mask
[seq, seq, 1], self.softmax = nn.Softmax(dim=1) (over keys j in the ijbh layout), einsum
('ijbh,jbhd->ibhd'), `output` Linear.  MHA 4 x 16.
Slip: the layers take a `softmax_dim` argument and the config lists [1, 1, 0]: layer 2's softmax runs
over dim 0 of [i, j, b, h], i.e. over the queries.
No cache.  Returns the logits tensor (batch, seq, vocab).
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
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
        "encoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "encoder.layers.2.self_attn",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "labml_nn RoPE AutoregressiveTransformer: seq-first [seq, batch, heads, d_k], PrepareForMultiHeadAttention, "
    "partial rotary 0.5 (halves) via query_rotary_pe/key_rotary_pe, einsum 'ibhd,jbhd->ijbh', nn.Softmax(dim=1), "
    "keyword-only query=/key=/value=/mask= call; layer 2 built with softmax_dim=0 (over queries)",
}


class PrepareForMultiHeadAttention(nn.Module):
    def __init__(self, d_model, heads, d_k, bias):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads = heads
        self.d_k = d_k

    def forward(self, x):
        head_shape = x.shape[:-1]
        x = self.linear(x)
        return x.view(*head_shape, self.heads, self.d_k)


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, d, base=10_000):
        super().__init__()
        self.base = base
        self.d = d

    def _build_cache(self, x):
        seq_len = x.shape[0]
        theta = 1.0 / (self.base ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d))
        seq_idx = torch.arange(seq_len, dtype=torch.float64)
        idx_theta = torch.einsum("n,d->nd", seq_idx, theta)
        idx_theta2 = torch.cat([idx_theta, idx_theta], dim=1)
        cos_cached = idx_theta2.cos()[:, None, None, :].to(x.dtype).to(x.device)
        sin_cached = idx_theta2.sin()[:, None, None, :].to(x.dtype).to(x.device)
        return cos_cached, sin_cached

    def forward(self, x):
        cos_cached, sin_cached = self._build_cache(x)
        x_rope, x_pass = x[..., : self.d], x[..., self.d :]
        d_2 = self.d // 2
        neg_half_x = torch.cat([-x_rope[:, :, :, d_2:], x_rope[:, :, :, :d_2]], dim=-1)
        x_rope = (x_rope * cos_cached[: x.shape[0]]) + (neg_half_x * sin_cached[: x.shape[0]])
        return torch.cat((x_rope, x_pass), dim=-1)


class MultiHeadAttention(nn.Module):
    def __init__(self, heads, d_model, dropout_prob=0.0, bias=True, softmax_dim=1):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.softmax = nn.Softmax(dim=softmax_dim)
        self.output = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout_prob)
        self.scale = 1 / math.sqrt(self.d_k)
        self.attn = None

    def get_scores(self, query, key):
        return torch.einsum("ibhd,jbhd->ijbh", query, key)

    def prepare_mask(self, mask, query_shape, key_shape):
        assert mask.shape[0] == 1 or mask.shape[0] == query_shape[0]
        assert mask.shape[1] == key_shape[0]
        assert mask.shape[2] == 1 or mask.shape[2] == query_shape[1]
        return mask.unsqueeze(-1)

    def forward(self, *, query, key, value, mask=None):
        seq_len, batch_size, _ = query.shape
        if mask is not None:
            mask = self.prepare_mask(mask, query.shape, key.shape)
        query = self.query(query)
        key = self.key(key)
        value = self.value(value)
        scores = self.get_scores(query, key)
        scores = scores * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.softmax(scores)
        attn = self.dropout(attn)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        self.attn = attn.detach()
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)


class RotaryPEMultiHeadAttention(MultiHeadAttention):
    def __init__(self, heads, d_model, rope_percentage=0.5, dropout_prob=0.0, softmax_dim=1):
        super().__init__(heads, d_model, dropout_prob, softmax_dim=softmax_dim)
        d_rope = int(self.d_k * rope_percentage)
        self.query_rotary_pe = RotaryPositionalEmbeddings(d_rope)
        self.key_rotary_pe = RotaryPositionalEmbeddings(d_rope)

    def get_scores(self, query, key):
        return torch.einsum("ibhd,jbhd->ijbh", self.query_rotary_pe(query), self.key_rotary_pe(key))


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.0):
        super().__init__()
        self.layer1 = nn.Linear(d_model, d_ff)
        self.layer2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = nn.ReLU()

    def forward(self, x):
        return self.layer2(self.dropout(self.activation(self.layer1(x))))


class TransformerLayer(nn.Module):
    def __init__(self, *, d_model, self_attn, feed_forward, dropout_prob=0.0):
        super().__init__()
        self.size = d_model
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.dropout = nn.Dropout(dropout_prob)
        self.norm_self_attn = nn.LayerNorm([d_model])
        self.norm_ff = nn.LayerNorm([d_model])

    def forward(self, *, x, mask):
        z = self.norm_self_attn(x)
        self_attn = self.self_attn(query=z, key=z, value=z, mask=mask)
        x = x + self.dropout(self_attn)
        z = self.norm_ff(x)
        ff = self.feed_forward(z)
        return x + self.dropout(ff)


class Encoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm([layers[0].size])

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x=x, mask=mask)
        return self.norm(x)


def subsequent_mask(seq_len):
    return torch.tril(torch.ones(seq_len, seq_len)).to(torch.bool).unsqueeze(-1)


class AutoregressiveTransformer(nn.Module):
    def __init__(self, encoder, src_embed, generator):
        super().__init__()
        self.src_embed = src_embed
        self.encoder = encoder
        self.generator = generator
        self.mask = None

    def forward(self, x):
        x = x.transpose(0, 1)  # labml is sequence-first: [seq_len, batch]
        if self.mask is None or self.mask.size(0) != len(x):
            self.mask = subsequent_mask(len(x)).to(x.device)
        x = self.src_embed(x)
        x = self.encoder(x, self.mask)
        x = self.generator(x)
        return x.transpose(0, 1)


def make_model():
    torch.manual_seed(1606)
    c = SimpleNamespace(n_tokens=96, d_model=64, heads=4, d_ff=128, n_layers=3, softmax_dims=[1, 1, 0])
    layers = [
        TransformerLayer(
            d_model=c.d_model,
            self_attn=RotaryPEMultiHeadAttention(c.heads, c.d_model, 0.5, softmax_dim=c.softmax_dims[i]),
            feed_forward=FeedForward(c.d_model, c.d_ff),
        )
        for i in range(c.n_layers)
    ]
    model = AutoregressiveTransformer(
        Encoder(layers), nn.Embedding(c.n_tokens, c.d_model), nn.Linear(c.d_model, c.n_tokens)
    )
    g = torch.Generator().manual_seed(16061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()
