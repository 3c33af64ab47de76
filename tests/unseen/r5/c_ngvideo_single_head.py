"""ng-video-lecture's first model step: one causal Head of size n_embd (key/query/value without bias, tril buffer), used on its own."""

import torch
import torch.nn as nn
from torch.nn import functional as F

n_embd = 20
block_size = 64


class Head(nn.Module):
    """one head of self-attention"""

    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        v = self.value(x)
        return wei @ v


def make_sa_head():
    return Head(n_embd)


EXPECT = {
    "target": "make_sa_head",
    "kind": "causal",
    "ok": True,
    "style": "Karpathy ng-video-lecture single self-attention head (sa_head = Head(n_embd))",
}
