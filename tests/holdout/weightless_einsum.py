"""Weightless self-attention with einsum and F.softmax; batch dims via the ellipsis."""

import torch
import torch.nn.functional as F


def attend(X):
    S = torch.einsum("...ij,...kj->...ik", X, X)
    A = F.softmax(S, dim=-1)
    return torch.einsum("...ik,...kj->...ij", A, X)


EXPECT = {"target": "attend", "kind": "simplified", "ok": True}
