"""Simplified self-attention with softmax written as exp(s - logsumexp(s))."""

import torch


def lse_attention(x):
    s = x @ x.transpose(-1, -2)
    w = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
    return w @ x


EXPECT = {"target": "lse_attention", "kind": "simplified", "ok": True}
