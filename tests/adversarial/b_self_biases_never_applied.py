"""Self-attention via F.linear whose bias parameters are declared and never applied."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FLinearBiasSlip(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.q_w = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.q_b = nn.Parameter(torch.randn(d_out) * 0.3)
        self.k_w = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.k_b = nn.Parameter(torch.randn(d_out) * 0.3)
        self.v_w = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.v_b = nn.Parameter(torch.randn(d_out) * 0.3)

    def forward(self, x):
        q = F.linear(x, self.q_w)
        k = F.linear(x, self.k_w)
        v = F.linear(x, self.v_w)
        s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        return s.softmax(-1) @ v


EXPECT = {
    "target": "FLinearBiasSlip",
    "kind": "self",
    "ok": False,
    "stage": "queries",
    "mistake": "wrong_projection",
}
