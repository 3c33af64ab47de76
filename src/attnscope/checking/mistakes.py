"""The mistake codes: a public contract, shared by the checker, its JSON and the docs."""

from __future__ import annotations

from ..stages import Stage

__all__ = ["MISTAKES", "Mistake"]


class Mistake:
    """A mistake code, the stages where it can show first, and what it means.

    ``modern`` codes belong to modern attention (grouped heads, rotary positions, QK norm,
    windows, position biases, cross-attention): part of the contract, reported once the
    checker models those layers.
    """

    def __init__(self, code: str, stages: tuple[Stage, ...], meaning: str):
        self.code, self.stages, self.meaning = code, stages, meaning
        self.modern = code in _MODERN

    def __repr__(self) -> str:
        return f"Mistake({self.code!r})"


_MODERN = {
    "wrong_source",
    "qk_norm_missing",
    "qk_norm_misplaced",
    "rope_missing",
    "rope_pairing",
    "rope_positions",
    "rope_on_values",
    "kv_group_mapping",
    "bias_missing",
    "bias_slopes",
    "bias_sign",
    "window_missing",
    "window_size",
}
_QKV = (Stage.QUERIES, Stage.KEYS, Stage.VALUES)
_NORMED = (Stage.NORMED_QUERIES, Stage.NORMED_KEYS)
_ROTATED = (Stage.ROTATED_QUERIES, Stage.ROTATED_KEYS)

#: code -> Mistake, in pipeline order.
MISTAKES: dict[str, Mistake] = {
    m.code: m
    for m in [
        Mistake("wrong_projection", _QKV, "computed with another projection's weights"),
        Mistake(
            "wrong_source",
            _QKV,
            "cross-attention: keys or values projected from the query input, or queries from "
            "the context",
        ),
        Mistake("heads_split", _QKV, "heads cut out of the wrong axis, mixing tokens or features"),
        Mistake("wrong_query_token", (Stage.QUERY,), "the query taken from another token"),
        Mistake(
            "qk_norm_missing",
            _NORMED,
            "the layer has a QK norm and does not apply it to the queries or the keys",
        ),
        Mistake(
            "qk_norm_misplaced", _NORMED, "the QK norm applied after the rotation instead of before"
        ),
        Mistake("rope_missing", _ROTATED, "queries or keys not rotated while the other is"),
        Mistake(
            "rope_pairing",
            _ROTATED,
            "the cos/sin tables laid out for one pairing (halves, or interleaved pairs) and "
            "applied with the other: not a rotation",
        ),
        Mistake(
            "rope_positions",
            _ROTATED,
            "rotated for the wrong positions (not 0..n-1 plus the cache offset, or queries and "
            "keys at different positions)",
        ),
        Mistake("rope_on_values", (Stage.VALUES,), "the rotation applied to the values"),
        Mistake("wrong_key_index", (Stage.SCORES,), "a score written at another key's position"),
        Mistake(
            "scores_transposed", (Stage.SCORES,), "keys times queries instead of queries times keys"
        ),
        Mistake("not_dot_product", (Stage.SCORES,), "scores that are not query . key"),
        Mistake("batch_mixing", (Stage.SCORES,), "one sequence attends to another's tokens"),
        Mistake(
            "kv_group_mapping",
            (Stage.SCORES, Stage.CONTEXT),
            "a query head paired with the wrong key/value head (expected kv head "
            "h // (heads / kv_heads))",
        ),
        Mistake("missing_scale", (Stage.SCALED_SCORES,), "scores not divided by sqrt(d_k)"),
        Mistake(
            "wrong_scale",
            (Stage.SCALED_SCORES,),
            "scores scaled by another factor than 1/sqrt(d_k)",
        ),
        Mistake(
            "bias_missing",
            (Stage.BIASED_SCORES,),
            "the layer has a position bias and does not add it",
        ),
        Mistake(
            "bias_slopes",
            (Stage.BIASED_SCORES,),
            "ALiBi slopes that are not the standard geometric sequence for this head count",
        ),
        Mistake("bias_sign", (Stage.BIASED_SCORES,), "the position bias favours distant tokens"),
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
        Mistake(
            "window_missing",
            (Stage.MASKED_SCORES,),
            "the layer declares a sliding window and does not apply it",
        ),
        Mistake(
            "window_size",
            (Stage.MASKED_SCORES,),
            "the sliding window is wider or narrower than declared",
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
