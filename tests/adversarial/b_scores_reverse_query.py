"""Attention scores where the query is counted from the end: inputs[len(inputs) - 1 - query_index]."""

import torch


def scores_for(inputs, query_index):
    n = inputs.shape[0]
    query = inputs[n - 1 - query_index]
    return torch.stack([torch.dot(row, query) for row in inputs])


EXPECT = {
    "target": "scores_for",
    "kind": "scores",
    "ok": False,
    "stage": "query",
    "mistake": "wrong_query_token",
}
