"""Attention scores for one query using inputs[query_index + 1] (off by one on the query)."""

import torch


def attention_scores(inputs, query_index):
    query = inputs[query_index + 1]
    return torch.stack([torch.dot(x_i, query) for x_i in inputs])


EXPECT = {
    "target": "attention_scores",
    "kind": "scores",
    "ok": False,
    "stage": "query",
    "mistake": "wrong_query_token",
}
