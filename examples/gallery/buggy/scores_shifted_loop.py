"""Attention scores with an off-by-one index into the inputs inside the loop."""

import torch


def attention_scores(inputs, query_index):
    query = inputs[query_index]
    attn_scores = torch.empty(len(inputs), dtype=inputs.dtype)
    for i in range(len(inputs)):
        attn_scores[i] = torch.dot(inputs[i - 1], query)
    return attn_scores


EXPECT = {
    "target": "attention_scores",
    "kind": "scores",
    "ok": False,
    "stage": "scores",
    "mistake": "wrong_key_index",
}
