"""Simplified (weightless) self-attention with nested loops (book section 3.3.2)."""

import torch


def simplified_attention(inputs):
    n = inputs.shape[0]
    attn_scores = torch.empty(n, n, dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        for j, x_j in enumerate(inputs):
            attn_scores[i, j] = torch.dot(x_i, x_j)

    attn_weights = torch.softmax(attn_scores, dim=-1)

    all_context_vecs = torch.zeros_like(inputs)
    for i in range(n):
        for j in range(n):
            all_context_vecs[i] += attn_weights[i, j] * inputs[j]
    return all_context_vecs


EXPECT = {"target": "simplified_attention", "kind": "simplified", "ok": True}
