"""The mistake codes: a public contract, shared by the checker, its JSON and the docs."""

from __future__ import annotations

from ..stages import Stage

__all__ = ["MISTAKES", "Mistake"]


class Mistake:
    """A mistake code, the stages where it can show first, and what it means."""

    def __init__(self, code: str, stages: tuple[Stage, ...], meaning: str):
        self.code, self.stages, self.meaning = code, stages, meaning

    def __repr__(self) -> str:
        return f"Mistake({self.code!r})"


_QKV = (Stage.QUERIES, Stage.KEYS, Stage.VALUES)

#: code -> Mistake, in pipeline order.
MISTAKES: dict[str, Mistake] = {
    m.code: m
    for m in [
        Mistake("wrong_projection", _QKV, "computed with another projection's weights"),
        Mistake("heads_split", _QKV, "heads cut out of the wrong axis, mixing tokens or features"),
        Mistake("wrong_query_token", (Stage.QUERY,), "the query taken from another token"),
        Mistake("wrong_key_index", (Stage.SCORES,), "a score written at another key's position"),
        Mistake(
            "scores_transposed", (Stage.SCORES,), "keys times queries instead of queries times keys"
        ),
        Mistake("not_dot_product", (Stage.SCORES,), "scores that are not query . key"),
        Mistake("batch_mixing", (Stage.SCORES,), "one sequence attends to another's tokens"),
        Mistake("missing_scale", (Stage.SCALED_SCORES,), "scores not divided by sqrt(d_k)"),
        Mistake(
            "wrong_scale",
            (Stage.SCALED_SCORES,),
            "scores scaled by another factor than 1/sqrt(d_k)",
        ),
        Mistake("missing_mask", (Stage.MASKED_SCORES,), "future tokens not masked"),
        Mistake(
            "mask_diagonal",
            (Stage.MASKED_SCORES,),
            "the mask hides the token itself or shows a future token",
        ),
        Mistake(
            "mask_fill_value",
            (Stage.MASKED_SCORES,),
            "masked scores filled with a finite value that still gets weight",
        ),
        Mistake("softmax_wrong_dim", (Stage.WEIGHTS,), "softmax over another axis than the keys"),
        Mistake(
            "not_softmax", (Stage.WEIGHTS,), "weights normalised by something other than softmax"
        ),
        Mistake(
            "unstable_softmax",
            (Stage.WEIGHTS,),
            "a softmax that overflows to inf or NaN on large scores",
        ),
        Mistake(
            "mask_after_softmax", (Stage.WEIGHTS,), "masked after the softmax without renormalising"
        ),
        Mistake(
            "context_wrong_product", (Stage.CONTEXT,), "weights and values combined the wrong way"
        ),
        Mistake("heads_merge", (Stage.OUTPUT,), "heads concatenated in the wrong order or axis"),
        Mistake("missing_out_proj", (Stage.OUTPUT,), "the output projection is not applied"),
        Mistake("other", tuple(Stage), "something none of the codes above explains"),
    ]
}
