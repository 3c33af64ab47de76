"""Informer/Autoformer-family decoder cross-attention: AttentionLayer(FullAttention(mask_flag=False))
with the decoder states as queries and the encoder output ("cross") as keys and values, einsum
"blhe,bshe->bhls" scores, softmax(scale * scores), einsum "bhls,bshd->blhd", out_projection, post-norm."""

from math import sqrt

import torch
from torch import nn


class FullAttention(nn.Module):
    def __init__(
        self, mask_flag=True, factor=5, scale=None, attention_dropout=0.1, output_attention=False
    ):
        super().__init__()
        self.scale = scale
        self.mask_flag = mask_flag
        self.output_attention = output_attention
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, queries, keys, values, attn_mask):
        B, L, H, E = queries.shape
        _, S, _, D = values.shape
        scale = self.scale or 1.0 / sqrt(E)
        scores = torch.einsum("blhe,bshe->bhls", queries, keys)
        A = self.dropout(torch.softmax(scale * scores, dim=-1))
        V = torch.einsum("bhls,bshd->blhd", A, values)
        return V.contiguous(), None


class AttentionLayer(nn.Module):
    def __init__(self, attention, d_model, n_heads, d_keys=None, d_values=None, mix=False):
        super().__init__()
        d_keys = d_keys or (d_model // n_heads)
        d_values = d_values or (d_model // n_heads)
        self.inner_attention = attention
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model, d_values * n_heads)
        self.out_projection = nn.Linear(d_values * n_heads, d_model)
        self.n_heads = n_heads
        self.mix = mix

    def forward(self, queries, keys, values, attn_mask):
        B, L, _ = queries.shape
        _, S, _ = keys.shape
        H = self.n_heads
        queries = self.query_projection(queries).view(B, L, H, -1)
        keys = self.key_projection(keys).view(B, S, H, -1)
        values = self.value_projection(values).view(B, S, H, -1)
        out, attn = self.inner_attention(queries, keys, values, attn_mask)
        if self.mix:
            out = out.transpose(2, 1).contiguous()
        out = out.view(B, L, -1)
        return self.out_projection(out), attn


class DecoderCrossLayer(nn.Module):
    def __init__(self, d_model=64, n_heads=4, factor=5, dropout=0.05):
        super().__init__()
        self.cross_attention = AttentionLayer(
            FullAttention(False, factor, attention_dropout=dropout, output_attention=False),
            d_model,
            n_heads,
            mix=False,
        )
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, cross, cross_mask=None):
        x = x + self.cross_attention(x, cross, cross, attn_mask=cross_mask)[0]
        return self.norm2(x)


def make_informer_cross():
    torch.manual_seed(1104)
    layer = DecoderCrossLayer()
    with torch.no_grad():
        layer.norm2.weight.uniform_(0.5, 1.5)
        layer.norm2.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_informer_cross",
    "kind": "cross",
    "ok": True,
    "layer": "cross_attention",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Informer/Autoformer decoder cross-attention: "
    "AttentionLayer(FullAttention(mask_flag=False)) with queries from the decoder and "
    "keys/values from the 64-wide encoder output, post-norm",
}
