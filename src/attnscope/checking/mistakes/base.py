"""The contract's mistake codes, and the shape of what the checker attaches to each (see
the package's docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...stages import Stage
from ..reference import Mutation, Spec

__all__ = ["MISTAKES", "Mistake", "Context", "Evidence", "define"]

T = torch.Tensor


@dataclass
class Context:
    """What the catalogue needs to make its mutations: the spec, the probe's sizes, the
    layout of the weights and the projections' biases."""

    spec: Spec
    tokens: int
    batch: int
    combined_qkv: bool = False
    biases: tuple[T | None, T | None, T | None] = (None, None, None)
    #: keys and values from one combined projection (``[k|v]``: PVT's ``kv``, a
    #: cross-attention's fused key/value)
    combined_kv: bool = False


@dataclass
class Evidence:
    """A user's tensor at a failing stage (``(B, ...)``, reference layout; None when the
    stage was never seen), the reference stages of the same call, and the stages found."""

    user: T | None
    ref: dict[str, T]
    found: dict = field(default_factory=dict)


@dataclass
class Mistake:
    """A mistake code, the stages where it can show first, what it means, and (where the
    checker models it) its mutations, recogniser and expected-sentence."""

    code: str
    stages: tuple[Stage, ...]
    meaning: str
    modern: bool = False
    mutate: Callable[[Context], list[Mutation]] | None = field(default=None, repr=False)
    recognise: Callable[[Evidence], bool] | None = field(default=None, repr=False)
    expected: Callable[[Spec], str] | None = field(default=None, repr=False)
    #: mistakes of the ``scores`` kind, f(inputs, query_index): [(stage, label, fn)]
    one_query: Callable[[], list] | None = field(default=None, repr=False)
    #: what the ``scores`` kind expected instead (its message's last sentence)
    one_query_expected: str = ""
    #: the opening of the message, when "stage: meaning: found label" does not fit
    headline: Callable[[Mutation, Spec], str] | None = field(default=None, repr=False)

    def message(self, mut: Mutation, spec: Spec) -> str:
        """``stage: what happened: found ... . Expected ...``."""
        if self.headline is not None:
            head = self.headline(mut, spec)
        else:
            head = f"{mut.stage.value}: {self.meaning}: found {mut.label}"
        expected = self.expected(spec) if self.expected is not None else ""
        return head + (f". {expected[:1].upper()}{expected[1:]}" if expected else "")


_QKV = (Stage.QUERIES, Stage.KEYS, Stage.VALUES)
_NORMED = (Stage.NORMED_QUERIES, Stage.NORMED_KEYS)
_ROTATED = (Stage.ROTATED_QUERIES, Stage.ROTATED_KEYS)
_S, _W, _M = Stage.SCORES, Stage.WEIGHTS, Stage.MASKED_SCORES


def _modern(code: str, stages: tuple[Stage, ...], meaning: str) -> Mistake:
    return Mistake(code, stages, meaning, modern=True)


#: code -> Mistake, in the contract's order (pipeline order).
MISTAKES: dict[str, Mistake] = {
    m.code: m
    for m in [
        Mistake("wrong_projection", _QKV, "computed with another projection's weights"),
        _modern(
            "wrong_source",
            _QKV,
            "cross-attention: keys or values projected from the query input, or queries from "
            "the context",
        ),
        Mistake("heads_split", _QKV, "heads cut out of the wrong axis, mixing tokens or features"),
        Mistake("wrong_query_token", (Stage.QUERY,), "the query taken from another token"),
        _modern(
            "qk_norm_missing",
            _NORMED,
            "the layer has a QK norm and does not apply it to the queries or the keys",
        ),
        _modern(
            "qk_norm_misplaced", _NORMED, "the QK norm applied after the rotation instead of before"
        ),
        _modern("rope_missing", _ROTATED, "queries or keys not rotated while the other is"),
        _modern(
            "rope_pairing",
            _ROTATED,
            "the cos/sin tables laid out for one pairing (halves, or interleaved pairs) and "
            "applied with the other: not a rotation",
        ),
        _modern(
            "rope_positions",
            _ROTATED,
            "rotated for the wrong positions (not 0..n-1 plus the cache offset, or queries and "
            "keys at different positions)",
        ),
        _modern("rope_on_values", (Stage.VALUES,), "the rotation applied to the values"),
        Mistake("wrong_key_index", (_S,), "a score written at another key's position"),
        Mistake("scores_transposed", (_S,), "keys times queries instead of queries times keys"),
        Mistake("not_dot_product", (_S,), "scores that are not query . key"),
        Mistake("batch_mixing", (_S,), "one sequence attends to another's tokens"),
        _modern(
            "kv_group_mapping",
            (_S, Stage.CONTEXT),
            "a query head paired with the wrong key/value head (expected kv head "
            "h // (heads / kv_heads))",
        ),
        Mistake("missing_scale", (Stage.SCALED_SCORES,), "scores not divided by sqrt(d_k)"),
        Mistake(
            "wrong_scale",
            (Stage.SCALED_SCORES,),
            "scores scaled by another factor than 1/sqrt(d_k)",
        ),
        _modern(
            "bias_missing",
            (Stage.BIASED_SCORES,),
            "the layer has a position bias and does not add it",
        ),
        _modern(
            "bias_slopes",
            (Stage.BIASED_SCORES,),
            "ALiBi slopes that are not the standard geometric sequence for this head count",
        ),
        _modern("bias_sign", (Stage.BIASED_SCORES,), "the position bias favours distant tokens"),
        Mistake("missing_mask", (_M,), "future tokens not masked"),
        Mistake("mask_diagonal", (_M,), "the mask hides the token itself or shows a future token"),
        Mistake(
            "mask_fill_value",
            (_M,),
            "masked scores filled with a finite value that still gets weight",
        ),
        _modern(
            "window_missing", (_M,), "the layer declares a sliding window and does not apply it"
        ),
        _modern("window_size", (_M,), "the sliding window is wider or narrower than declared"),
        Mistake("softmax_wrong_dim", (_W,), "softmax over another axis than the keys"),
        Mistake("not_softmax", (_W,), "weights normalised by something other than softmax"),
        Mistake(
            "unstable_softmax", (_W,), "a softmax that overflows to inf or NaN on large scores"
        ),
        Mistake("mask_after_softmax", (_W,), "masked after the softmax without renormalising"),
        Mistake(
            "context_wrong_product", (Stage.CONTEXT,), "weights and values combined the wrong way"
        ),
        Mistake("heads_merge", (Stage.OUTPUT,), "heads concatenated in the wrong order or axis"),
        Mistake("missing_out_proj", (Stage.OUTPUT,), "the output projection is not applied"),
        Mistake("other", tuple(Stage), "something none of the codes above explains"),
    ]
}


def define(
    code: str,
    *,
    expected: Callable[[Spec], str] | str | None = None,
    recognise: Callable[[Evidence], bool] | None = None,
    one_query: Callable[[], list] | None = None,
    one_query_expected: str = "",
    headline: Callable[[Mutation, Spec], str] | None = None,
) -> Callable:
    """Attach a code's behaviour; the decorated function makes its mutations."""
    m = MISTAKES[code]
    if expected is not None:
        m.expected = expected if callable(expected) else (lambda spec, text=expected: text)
    m.recognise, m.one_query, m.headline = recognise, one_query, headline
    m.one_query_expected = one_query_expected

    def attach(fn: Callable[[Context], list[Mutation]]) -> Callable[[Context], list[Mutation]]:
        m.mutate = fn
        return fn

    return attach
