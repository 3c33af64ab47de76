"""GPT-2-ish causal MHA with a fused (in, 3*out) weight, unpacked as q, v, k by mistake."""

import torch
import torch.nn as nn


class FusedCausalMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads):
        super().__init__()
        self.h = num_heads
        self.d_out = d_out
        self.c_attn_w = nn.Parameter(torch.randn(d_in, 3 * d_out) * 0.3)
        self.c_attn_b = nn.Parameter(torch.zeros(3 * d_out))
        self.c_proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        B, T, _ = x.shape
        qkv = torch.addmm(self.c_attn_b, x.reshape(B * T, -1), self.c_attn_w).reshape(B, T, -1)
        q, v, k = qkv.split(self.d_out, dim=-1)
        hd = self.d_out // self.h
        q, k, v = (t.reshape(B, T, self.h, hd).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1) / hd**0.5
        att = att.masked_fill(self.mask[:T, :T] == 0, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, self.d_out))


EXPECT = {
    "target": "FusedCausalMHA",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "keys",
    "mistake": "wrong_projection",
}
