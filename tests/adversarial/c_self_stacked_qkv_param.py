"""Self-attention with one nn.Parameter of shape (3, d_in, d_out) holding W_q, W_k, W_v."""

import torch
import torch.nn as nn


class StackedQKV(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_qkv = nn.Parameter(torch.randn(3, d_in, d_out) * d_in**-0.5)

    def forward(self, x):
        q, k, v = torch.einsum("btd,sde->sbte", x, self.W_qkv).unbind(0)
        a = torch.softmax(torch.einsum("bie,bje->bij", q, k) / q.shape[-1] ** 0.5, dim=2)
        return torch.einsum("bij,bje->bie", a, v)


EXPECT = {"target": "StackedQKV", "kind": "self", "ok": True}
