"""Attention scores for one query token as a single matrix-vector product."""

import torch


def query_scores(inputs, query_index):
    query = inputs[query_index]
    return torch.matmul(inputs, query)


EXPECT = {"target": "query_scores", "kind": "scores", "ok": True}
