"""nanoGPT-style causal head multiplying the softmaxed weights by the tril buffer."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.key = nn.Linear(d_in, d_out, bias=False)
        self.query = nn.Linear(d_in, d_out, bias=False)
        self.value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = F.softmax(wei, dim=-1)
        wei = wei * self.tril[:T, :T]
        return wei @ self.value(x)


EXPECT = {
    "target": "Head",
    "kind": "causal",
    "ok": False,
    "stage": "weights",
    "mistake": "mask_after_softmax",
}
