"""Informer FullAttention: masked_fill (out of place) instead of masked_fill_, result discarded, so no causal mask

Base: Informer/Autoformer-family full attention (time-series): AttentionLayer with query/key/value/out
projections to (B, L, H, E), FullAttention with einsum "blhe,bshe->bhls", scale = self.scale or
1/sqrt(E), a TriangularCausalMask (triu diagonal=1) filled with -inf, softmax(scale * scores) and
einsum "bhls,bshd->blhd". Decoder self-attention (mask_flag=True, mix=False) in a post-norm layer.
"""

from math import sqrt

import torch
from torch import nn


class TriangularCausalMask:
    def __init__(self, B, L, device="cpu"):
        mask_shape = [B, 1, L, L]
        with torch.no_grad():
            self._mask = torch.triu(torch.ones(mask_shape, dtype=torch.bool), diagonal=1).to(device)

    @property
    def mask(self):
        return self._mask


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
        if self.mask_flag:
            if attn_mask is None:
                attn_mask = TriangularCausalMask(B, L, device=queries.device)
            scores.masked_fill(attn_mask.mask, -float("inf"))
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


class DecoderSelfLayer(nn.Module):
    def __init__(self, d_model=64, n_heads=4, factor=5, dropout=0.05):
        super().__init__()
        self.self_attention = AttentionLayer(
            FullAttention(True, factor, attention_dropout=dropout, output_attention=False),
            d_model,
            n_heads,
            mix=False,
        )
        self.norm1 = nn.LayerNorm(d_model)

    def forward(self, x, x_mask=None):
        x = x + self.self_attention(x, x, x, attn_mask=x_mask)[0]
        return self.norm1(x)


def make_informer_decoder():
    torch.manual_seed(1103)
    layer = DecoderSelfLayer()
    with torch.no_grad():
        layer.norm1.weight.uniform_(0.5, 1.5)
        layer.norm1.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_informer_decoder",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attention",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "Informer FullAttention: masked_fill (out of place) instead of masked_fill_, result "
    "discarded, so no causal mask",
}
