"""All projections in one (3, heads, d_model, head_dim) parameter, output weights (heads, head_dim, d_model), einsum throughout."""

import math

import torch
from torch import nn


class FusedHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, context_length=64, bias=True):
        super().__init__()
        assert d_model % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.w_qkv = nn.Parameter(torch.empty(3, num_heads, d_model, self.head_dim))
        self.b_qkv = nn.Parameter(torch.empty(3, num_heads, self.head_dim)) if bias else None
        self.w_out = nn.Parameter(torch.empty(num_heads, self.head_dim, d_model))
        self.b_out = nn.Parameter(torch.empty(d_model)) if bias else None
        keep = torch.ones(context_length, context_length, dtype=torch.bool).tril()
        self.register_buffer("keep", keep, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        d_model = self.w_qkv.shape[2]
        nn.init.normal_(self.w_qkv, std=d_model**-0.5)
        nn.init.normal_(self.w_out, std=d_model**-0.5)
        if self.b_qkv is not None:
            nn.init.normal_(self.b_qkv, std=0.1)
            nn.init.normal_(self.b_out, std=0.1)

    def forward(self, x):
        t = x.shape[-2]
        qkv = torch.einsum("...tc,shcd->s...htd", x, self.w_qkv)
        if self.b_qkv is not None:
            lead = [1] * (x.dim() - 2)
            qkv = qkv + self.b_qkv.view(3, *lead, self.num_heads, 1, self.head_dim)
        q, k, v = qkv.unbind(0)

        scores = torch.einsum("...hid,...hjd->...hij", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.keep[:t, :t], float("-inf"))
        probs = scores.softmax(dim=-1)
        ctx = torch.einsum("...hij,...hjd->...hid", probs, v)
        out = torch.einsum("...hid,hdc->...ic", ctx, self.w_out)
        if self.b_out is not None:
            out = out + self.b_out
        return out


EXPECT = {
    "target": "FusedHeadAttention",
    "kind": "causal-multihead",
    "ok": True,
    "style": "weights as one (3, heads, d_model, head_dim) Parameter, output weights (heads, head_dim, d_model), einsum with '...'",
}
