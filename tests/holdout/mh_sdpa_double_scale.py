"""Causal multi-head attention pre-scaling queries by 1/sqrt(head_dim) before calling SDPA."""

import torch.nn as nn
import torch.nn.functional as F


class SDPACausalMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.h = num_heads
        self.dh = d_out // num_heads
        self.c_attn = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.c_proj = nn.Linear(d_out, d_out)
        self.p = dropout

    def forward(self, h):
        B, T, _ = h.shape
        Q, K, V = self.c_attn(h).split(self.h * self.dh, dim=2)
        Q = Q.view(B, T, self.h, self.dh).transpose(1, 2) / self.dh**0.5
        K = K.view(B, T, self.h, self.dh).transpose(1, 2)
        V = V.view(B, T, self.h, self.dh).transpose(1, 2)
        p = self.p if self.training else 0.0
        Y = F.scaled_dot_product_attention(Q, K, V, is_causal=True, dropout_p=p)
        return self.c_proj(Y.transpose(1, 2).contiguous().view(B, T, -1))


EXPECT = {
    "target": "SDPACausalMHA",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
}
