"""Query scores via broadcasting: elementwise product with the query row, summed over features."""

import torch


def scores_for(inputs, query_index):
    q = inputs[query_index]
    return torch.sum(inputs * q, dim=1)


EXPECT = {"target": "scores_for", "kind": "scores", "ok": True}
