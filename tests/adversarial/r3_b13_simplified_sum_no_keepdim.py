"""Notebook simplified attention normalising by attn_scores.sum(dim=-1) without keepdim (broadcast along columns)."""


def simplified_attention(inputs):
    attn_scores = inputs @ inputs.T
    attn_weights = attn_scores / attn_scores.sum(dim=-1)
    return attn_weights @ inputs


EXPECT = {
    "target": "simplified_attention",
    "kind": "simplified",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
}
