"""labml.ai annotated deep-learning paper implementations: RotaryPEMultiHeadAttention.

Everything is sequence-first: [seq_len, batch_size, d_model]. PrepareForMultiHeadAttention
is a Linear followed by a view to [seq, batch, heads, d_k]; get_scores applies the
RotaryPositionalEmbeddings to the first half of each head's features (rope_percentage
0.5, halves layout: cat([-x[d/2:], x[:d/2]])) and uses einsum('ibhd,jbhd->ijbh'); the mask
is [seq_q, seq_k, batch] from subsequent_mask; softmax over dim=1 (the key axis); the
output Linear is applied to the merged heads. The decoder block transposes batch-first
input to sequence-first.
"""

import math

import torch
from torch import nn


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
        self.cos_cached = None
        self.sin_cached = None

    def _build_cache(self, x):
        if (
            self.cos_cached is not None
            and x.shape[0] <= self.cos_cached.shape[0]
            and self.cos_cached.dtype == x.dtype
        ):
            return
        seq_len = x.shape[0]
        theta = 1.0 / (self.base ** (torch.arange(0, self.d, 2).to(x.dtype) / self.d))
        seq_idx = torch.arange(seq_len).to(x.dtype)
        idx_theta = torch.einsum("n,d->nd", seq_idx, theta)
        idx_theta2 = torch.cat([idx_theta, idx_theta], dim=1)
        self.cos_cached = idx_theta2.cos()[:, None, None, :]
        self.sin_cached = idx_theta2.sin()[:, None, None, :]

    def _neg_half(self, x):
        d_2 = self.d // 2
        return torch.cat([-x[:, :, :, d_2:], x[:, :, :, :d_2]], dim=-1)

    def forward(self, x):
        self._build_cache(x)
        x_rope, x_pass = x[..., : self.d], x[..., self.d :]
        neg_half_x = self._neg_half(x_rope)
        x_rope = (x_rope * self.cos_cached[: x.shape[0]]) + (
            neg_half_x * self.sin_cached[: x.shape[0]]
        )
        return torch.cat((x_rope, x_pass), dim=-1)


class MultiHeadAttention(nn.Module):
    def __init__(self, heads, d_model, dropout_prob=0.0, bias=True):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.softmax = nn.Softmax(dim=1)
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
        scores *= self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.softmax(scores)
        attn = self.dropout(attn)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        self.attn = attn.detach()
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)


class RotaryPEMultiHeadAttention(MultiHeadAttention):
    def __init__(self, heads, d_model, rope_percentage=0.5, dropout_prob=0.0):
        super().__init__(heads, d_model, dropout_prob)
        d_rope = int(self.d_k * rope_percentage)
        self.query_rotary_pe = RotaryPositionalEmbeddings(d_rope)
        self.key_rotary_pe = RotaryPositionalEmbeddings(d_rope)

    def get_scores(self, query, key):
        return torch.einsum("ibhd,jbhd->ijbh", self.query_rotary_pe(query), self.key_rotary_pe(key))


def subsequent_mask(seq_len):
    mask = torch.tril(torch.ones(seq_len, seq_len)).to(torch.bool).unsqueeze(-1)
    return mask


class TransformerLayer(nn.Module):
    def __init__(self, d_model=64, heads=4):
        super().__init__()
        self.self_attn = RotaryPEMultiHeadAttention(heads, d_model, rope_percentage=0.5)
        self.norm_self_attn = nn.LayerNorm([d_model])

    def forward(self, *, x, mask):
        z = self.norm_self_attn(x)
        self_attn = self.self_attn(query=z, key=z, value=z, mask=mask)
        return x + self_attn


class BatchFirstDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = TransformerLayer()

    def forward(self, x):
        x = x.transpose(0, 1)  # [seq, batch, d_model]
        mask = subsequent_mask(x.shape[0])
        x = self.layer(x=x, mask=mask)
        return x.transpose(0, 1)


def make_labml_decoder():
    torch.manual_seed(113)
    dec = BatchFirstDecoder()
    with torch.no_grad():
        dec.layer.norm_self_attn.weight.uniform_(0.5, 1.5)
        dec.layer.norm_self_attn.bias.uniform_(-0.1, 0.1)
    return dec.eval()


EXPECT = {
    "target": "make_labml_decoder",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layer.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "labml.ai RotaryPEMultiHeadAttention (sequence-first [seq, batch, d], PrepareForMultiHeadAttention, "
    "rope_percentage 0.5 halves rotation, einsum 'ibhd,jbhd->ijbh', [seq_q, seq_k, batch] subsequent_mask, softmax dim=1), "
    "keyword-only forward(query=, key=, value=, mask=)",
}
