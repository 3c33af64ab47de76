"""Simplified attention: torch.empty nested-loop scores, softmax(dim=1), python sum() for the context."""

import torch


def self_attention_loops(inputs):
    n = inputs.shape[0]
    attn_scores = torch.empty(n, n)
    for i in range(n):
        for j in range(n):
            attn_scores[i, j] = inputs[i] @ inputs[j]
    attn_weights = torch.softmax(attn_scores, dim=1)
    context = torch.empty(inputs.shape)
    for i in range(n):
        context[i] = sum(attn_weights[i, j] * inputs[j] for j in range(n))
    return context


EXPECT = {"target": "self_attention_loops", "kind": "simplified", "ok": True}
