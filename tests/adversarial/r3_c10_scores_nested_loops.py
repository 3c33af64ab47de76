"""Notebook-style scores for one query: torch.empty and nested loops multiplying element by element."""

import torch


def compute_scores(inputs, query_index):
    query = inputs[query_index]
    attn_scores_2 = torch.empty(inputs.shape[0])
    for i, x_i in enumerate(inputs):
        total = 0.0
        for d in range(x_i.shape[0]):
            total += x_i[d] * query[d]
        attn_scores_2[i] = total
    return attn_scores_2


EXPECT = {"target": "compute_scores", "kind": "scores", "ok": True}
