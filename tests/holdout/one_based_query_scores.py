"""Query scores that treat query_index as a 1-based token number."""

import torch


def token_scores(inputs, query_index):
    q = inputs[query_index - 1]
    return torch.stack([row @ q for row in inputs])


EXPECT = {
    "target": "token_scores",
    "kind": "scores",
    "ok": False,
    "stage": "query",
    "mistake": "wrong_query_token",
}
