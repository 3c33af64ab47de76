"""Notebook simplified attention on 2-D input: @ with .T and torch.nn.Softmax(dim=1)."""

import torch


def simple_attention(inputs):
    attn_scores = inputs @ inputs.T
    softmax = torch.nn.Softmax(dim=1)
    attn_weights = softmax(attn_scores)
    all_context_vecs = attn_weights @ inputs
    return all_context_vecs


EXPECT = {"target": "simple_attention", "kind": "simplified", "ok": True}
