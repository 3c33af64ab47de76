"""Attention scores for one query: explicit loop with torch.dot (book section 3.3.1)."""

import torch


def attention_scores(inputs, query_index):
    query = inputs[query_index]
    attn_scores = torch.empty(inputs.shape[0], dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        attn_scores[i] = torch.dot(x_i, query)
    return attn_scores


EXPECT = {"target": "attention_scores", "kind": "scores", "ok": True}
