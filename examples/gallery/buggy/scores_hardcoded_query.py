"""Attention scores with the query still hard-coded from the notebook (inputs[1], "journey")."""

import torch


def attention_scores(inputs, query_index):
    query = inputs[1]
    attn_scores = torch.empty(inputs.shape[0], dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        attn_scores[i] = torch.dot(x_i, query)
    return attn_scores


EXPECT = {
    "target": "attention_scores",
    "kind": "scores",
    "ok": False,
    "stage": "query",
    "mistake": "wrong_query_token",
}
