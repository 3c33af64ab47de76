"""Causal attention with an arange comparison mask using >= (hides each token from itself)."""

import torch
import torch.nn as nn


class ArangeMaskCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = torch.bmm(q, k.transpose(1, 2)) / k.shape[-1] ** 0.5
        pos = torch.arange(t, device=x.device)
        future = pos[None, :] >= pos[:, None]
        s = s.masked_fill(future, torch.finfo(s.dtype).min)
        return torch.bmm(torch.softmax(s, -1), v)


EXPECT = {
    "target": "ArangeMaskCausal",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
}
