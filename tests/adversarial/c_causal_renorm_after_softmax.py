"""Causal attention: softmax over all keys, zero the future weights, then renormalise each row."""

import torch
import torch.nn as nn


class RenormCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        w = torch.softmax(q @ k.transpose(1, 2) / k.shape[-1] ** 0.5, dim=-1)
        w = w * torch.ones(t, t, dtype=w.dtype).tril()
        w = w / w.sum(dim=-1, keepdim=True)
        return w @ v


EXPECT = {"target": "RenormCausal", "kind": "causal", "ok": True}
