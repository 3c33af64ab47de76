"""Self-attention via F.linear where the query uses the key's bias (copy-paste slip)."""

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
        q = F.linear(x, self.q_w, self.k_b)
        k = F.linear(x, self.k_w, self.k_b)
        v = F.linear(x, self.v_w, self.v_b)
        s = torch.einsum("...id,...jd->...ij", q, k) * q.shape[-1] ** -0.5
        return torch.einsum("...ij,...jd->...id", s.softmax(-1), v)


EXPECT = {
    "target": "FLinearBiasSlip",
    "kind": "self",
    "ok": False,
    "stage": "queries",
    "mistake": "wrong_projection",
}
