"""Query scores that add the query to each row and sum, instead of multiplying."""


def scores_for(inputs, query_index):
    q = inputs[query_index]
    return (inputs + q).sum(dim=-1)


EXPECT = {
    "target": "scores_for",
    "kind": "scores",
    "ok": False,
    "stage": "scores",
    "mistake": "not_dot_product",
}
