"""Scores for one query as a row of the full inputs @ inputs.T matrix."""


def attn_scores_for(inputs, query_index):
    attn_scores = inputs @ inputs.T
    return attn_scores[query_index]


EXPECT = {"target": "attn_scores_for", "kind": "scores", "ok": True}
