"""Causal head: biased fused projection, .unbind, additive -inf float mask into SDPA."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FusedMaskedHead(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.to_qkv = nn.Linear(d_in, 3 * d_out, bias=True)

    def forward(self, h):
        B, T, _ = h.shape
        Q, K, V = self.to_qkv(h).view(B, T, 3, -1).unbind(dim=2)
        bias = torch.full((T, T), float("-inf"), dtype=h.dtype, device=h.device).triu(1)
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=bias)


EXPECT = {"target": "FusedMaskedHead", "kind": "causal", "ok": True}
