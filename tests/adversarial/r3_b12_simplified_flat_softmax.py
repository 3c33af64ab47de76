"""Simplified attention that softmaxes over the whole flattened score matrix."""

import torch


def simplified_attention(inputs):
    attn_scores = inputs @ inputs.T
    attn_weights = torch.softmax(attn_scores.flatten(), dim=0).view_as(attn_scores)
    return attn_weights @ inputs


EXPECT = {
    "target": "simplified_attention",
    "kind": "simplified",
    "ok": False,
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
}
