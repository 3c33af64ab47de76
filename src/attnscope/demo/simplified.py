"""Simplified attention, the first seed: no weights, the tokens are their own queries.

One query scored against every token three ways (a loop, ``torch.dot``, one product), the
scores normalised three ways (by the sum, a naive and the stable softmax), and then every
query at once.
"""

from __future__ import annotations

import torch

from .. import functional as AF
from ..examples import TOY_TOKENS, toy_scores
from ..lesson import Check, Shown, Step
from ..trace import ShapeCheck, Trace
from .checks import (
    BOOK_TOKEN,
    EXP_RANGE,
    agree,
    book,
    dot_rounding,
    matrix_note,
    output_shape,
    rows_are_distributions,
    shapes,
    show,
    trace_rows,
    walk_check,
)

PART = "simplified"


def walk(x: torch.Tensor, labels: tuple[str, ...], t: int, is_book: bool, rows=None):
    """The weightless walk on ``x`` ``(T, d_in)`` for query ``t``: ``(steps, trace)``;
    ``rows``: a row trace of those queries (a long input)."""
    tr = trace_rows("simplified", x, labels, rows)
    is_book = is_book and t == BOOK_TOKEN
    scores = AF.query_scores_dot(x, x[t])
    steps = [
        _one_query(x, labels, t, is_book),
        _normalise(scores, labels, is_book),
        _large_scores(scores, labels),
        _toy_scores(),
        _every_query(tr, t, is_book),
    ]
    return steps, tr


def _one_query(x: torch.Tensor, labels: tuple[str, ...], t: int, is_book: bool) -> Step:
    query = x[t]
    loop, dot = AF.query_scores_loop(x, query), AF.query_scores_dot(x, query)
    vec = AF.query_scores(x, query)
    rounding = dot_rounding(x, query)
    checks = [
        agree("the loop and torch.dot agree", loop, dot, "multiply-and-sum vs torch.dot", rounding),
        agree(
            "the vectorised inputs @ query agrees", loop, vec, "loop vs inputs @ query", rounding
        ),
    ]
    if is_book:
        checks.append(book("simplified scores", dot))
    return Step(
        PART,
        f"One query against every token: {labels[t]!r} is the query",
        f"The query is token {t} (Python counts from 0). Predict: one score per token, "
        f"{len(labels)} numbers, largest where a token points the same way as the query.",
        [ShapeCheck("scores", (len(labels),), tuple(dot.shape), "one score per input token")],
        [Shown("query", query), Shown("scores", dot, None, labels)],
        checks,
    )


def _normalise(scores: torch.Tensor, labels: tuple[str, ...], is_book: bool) -> Step:
    by_sum = AF.normalize_sum(scores)
    naive, stable = AF.softmax_naive(scores, dim=0), AF.softmax(scores, dim=0)
    name = "the naive and the stable softmax agree on small scores"
    largest = scores.abs().max().item()
    if largest <= EXP_RANGE:
        same = agree(name, naive, stable, "exp(s)/sum(exp(s)) vs torch.softmax")
    else:  # not a failure: exp(s) itself leaves float32's range; the next step shows it
        same = Check(
            name,
            True,
            f"skipped: these scores are not small (largest |score| {largest:.4g} > "
            f"{EXP_RANGE:g}, where exp(s) over- or underflows float32); the next step "
            "shows what the naive softmax does then",
        )
    checks = [same, rows_are_distributions(stable, scores)]
    if is_book:
        checks += [book("simplified sum", by_sum), book("simplified softmax", stable)]
    return Step(
        PART,
        "Scores into weights",
        "Predict: dividing by the sum keeps the scores' proportions; softmax makes every "
        "weight positive and leans harder on the largest score. Both sum to 1.",
        [
            ShapeCheck(
                "weights", tuple(scores.shape), tuple(stable.shape), "same shape as the scores"
            )
        ],
        [Shown("divided by sum", by_sum, None, labels), Shown("softmax", stable, None, labels)],
        checks,
    )


def _large_scores(scores: torch.Tensor, labels: tuple[str, ...]) -> Step:
    big = scores + 1000.0  # exp(1000) is inf in float32 and float64: inf / inf is NaN
    naive, stable = AF.softmax_naive(big, dim=0), AF.softmax(big, dim=0)
    overflow = not bool(torch.isfinite(naive).all())
    finite = bool(torch.isfinite(stable).all())
    # scores + 1000 is rounded to float32, which moves each score by up to half a unit in
    # the last place of the largest: the weights may move by that much, and no more.
    rounding = torch.finfo(big.dtype).eps * big.abs().max().item()
    same = torch.allclose(stable, AF.softmax(scores, dim=0), atol=max(1e-5, 2 * rounding))
    return Step(
        PART,
        "Large scores: why the built-in softmax",
        "Add 1000 to every score. Predict: softmax only sees differences, so the weights "
        "should not change; but exp(1000) overflows, so the naive version breaks.",
        [],
        [Shown("naive", naive, None, labels), Shown("stable", stable, None, labels)],
        [
            Check(
                "the naive softmax overflows on large scores, the stable one does not",
                overflow and finite and same,
                f"naive: {int((~torch.isfinite(naive)).sum())} of {naive.numel()} "
                f"not finite; stable: finite={finite}, equals the small-score weights={same}",
            )
        ],
    )


def _toy_scores() -> Step:
    toy = toy_scores()
    by_sum, soft = AF.normalize_sum(toy), AF.softmax(toy, dim=0)
    return Step(
        PART,
        "The seed's toy scores: 'sat' against cat, sat, mat = 1, 5, 2",
        "Predict: the sum gives 1/8, 5/8, 2/8; softmax gives 'sat' far more than 5/8.",
        [],
        [
            Shown("scores", toy, None, TOY_TOKENS),
            Shown("divided by sum", by_sum, None, TOY_TOKENS),
            Shown("softmax", soft, None, TOY_TOKENS),
        ],
        [
            rows_are_distributions(torch.stack([by_sum, soft])),
            book("toy sum", by_sum),
            book("toy softmax", soft),
        ],
    )


def _every_query(tr: Trace, t: int, is_book: bool) -> Step:
    checks = [
        rows_are_distributions(tr["weights"], tr["scores"], rows=tr.rows),
        output_shape(tr["context"], tr.dims.tokens, tr.dims.d_in),
        walk_check(tr, t),
    ]
    if is_book:
        checks.append(book("simplified context", tr.walk(t).context))
    return Step(
        PART,
        "Every query at once: scores = inputs @ inputs.T",
        "Predict: a tokens x tokens score matrix (row = query, column = key)"
        f"{matrix_note(tr)}, weights of the same shape, and one context row per token with "
        "d_in columns; row "
        f"{t} must equal {tr.labels[t]!r} computed alone.",
        shapes(tr, ("scores", "weights", "context")),
        [show("weights", tr["weights"], tr, square=True), show("context", tr["context"], tr)],
        checks,
    )
