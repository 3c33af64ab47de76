"""Causal MHA calling scaled_dot_product_attention(..., scale=1.0), i.e. no 1/sqrt(d_k) at all."""

import torch.nn as nn
import torch.nn.functional as F


class SDPAScaleOne(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.d_out = d_out
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = dropout

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, self.d_out // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, scale=1.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, self.d_out))


EXPECT = {
    "target": "SDPAScaleOne",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "missing_scale",
}
