"""Causal multi-head attention: raw (out, in) weights via F.linear, einsum, finfo.min mask."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalMHA(nn.Module):
    def __init__(self, d_model, n_heads, context_length, dropout=0.0):
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.w_q = nn.Parameter(torch.randn(d_model, d_model) * d_model**-0.5)
        self.w_k = nn.Parameter(torch.randn(d_model, d_model) * d_model**-0.5)
        self.w_v = nn.Parameter(torch.randn(d_model, d_model) * d_model**-0.5)
        self.w_o = nn.Parameter(torch.randn(d_model, d_model) * d_model**-0.5)
        future = torch.ones(context_length, context_length).triu(1).bool()
        self.register_buffer("future", future)

    def forward(self, x):
        b, t, _ = x.shape
        q = F.linear(x, self.w_q).view(b, t, self.n_heads, self.d_head)
        k = F.linear(x, self.w_k).view(b, t, self.n_heads, self.d_head)
        v = F.linear(x, self.w_v).view(b, t, self.n_heads, self.d_head)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.d_head**0.5
        scores = scores.masked_fill(self.future[:t, :t], torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        ctx = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, -1)
        return F.linear(ctx, self.w_o)


EXPECT = {"target": "CausalMHA", "kind": "causal-multihead", "ok": True}
