"""Causal MHA with bias=True everywhere and a LayerNorm + extra Linear it never uses."""

import torch
import torch.nn as nn


class BiasedCausalMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads):
        super().__init__()
        self.n_heads = num_heads
        self.head_dim = d_out // num_heads
        self.ln = nn.LayerNorm(d_in)  # kept for a pre-norm variant, unused
        self.gate = nn.Linear(d_in, d_out)  # experimental gating, unused
        self.to_q = nn.Linear(d_in, d_out, bias=True)
        self.to_k = nn.Linear(d_in, d_out, bias=True)
        self.to_v = nn.Linear(d_in, d_out, bias=True)
        self.to_out = nn.Linear(d_out, d_out, bias=True)
        self.attn_drop = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(1, 1, context_length, context_length)))

    def forward(self, x):
        B, T, _ = x.shape

        def heads(t):
            return t.reshape(B, T, self.n_heads, self.head_dim).permute(0, 2, 1, 3)

        q, k, v = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))
        att = (q @ k.transpose(-1, -2)) * (1.0 / self.head_dim**0.5)
        att = att.masked_fill(self.causal[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_drop(torch.softmax(att, dim=-1))
        y = (att @ v).permute(0, 2, 1, 3).reshape(B, T, -1)
        return self.to_out(y)


EXPECT = {"target": "BiasedCausalMHA", "kind": "causal-multihead", "ok": True}
