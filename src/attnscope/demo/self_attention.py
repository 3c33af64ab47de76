"""Self-attention with trainable weights, the second seed: ``SelfAttentionV1`` and ``V2``.

The book's walk for one query: its projection, its scores, scaled and normalised weights
and context vector; then every token at once, the difference between weight parameters and
attention weights, and V2's ``nn.Linear`` computing the same thing as V1's matrices.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..lesson import Check, Shown, Step
from ..modules import SelfAttentionV1, SelfAttentionV2
from ..trace import QueryWalk, ShapeCheck, Trace, row_stages
from .checks import (
    BOOK_SEEDS,
    BOOK_TOKEN,
    agree,
    book,
    dot_rounding,
    forward_stages,
    logits,
    matrix_note,
    maxdiff,
    output_shape,
    rows_are_distributions,
    seeded,
    shapes,
    show,
    trace_rows,
    walk_check,
)

PART = "self"
D_OUT = 2  # as in the book


def walk(
    x: torch.Tensor, labels: tuple[str, ...], t: int, is_book: bool, seed: int | None, rows=None
):
    """SelfAttentionV1 (and V2) on ``x`` ``(T, d_in)``, d_out=2: ``(steps, trace)``;
    ``rows``: row traces of those queries (a long input)."""
    seed_v1 = BOOK_SEEDS["self"] if seed is None else seed
    with seeded(seed_v1):
        v1 = SelfAttentionV1(x.shape[-1], D_OUT)
    before = {n: p.detach().clone() for n, p in v1.named_parameters()}
    tr = trace_rows(v1, x, labels, rows)
    one = tr.walk(t)
    book_t = is_book and t == BOOK_TOKEN
    steps = [
        _weight_matrices(v1, seed_v1),
        _project_query(tr, one, t, book_t),
        _query_scores(tr, one, t, book_t),
        _query_weights(tr, one, book_t),
        _query_context(one, book_t),
        _every_token(tr, t, is_book),
        parameters_step(v1, before, x, labels, t, rows),
        _v2(x, labels, is_book, BOOK_SEEDS["v2"] if seed is None else seed, rows),
    ]
    return steps, tr


def _weight_matrices(v1: SelfAttentionV1, seed: int) -> Step:
    d_in, d_out = v1.d_in, v1.d_out
    return Step(
        PART,
        "Weight parameters: W_query, W_key, W_value",
        f"torch.manual_seed({seed}); SelfAttentionV1(d_in={d_in}, d_out={d_out}). Predict: "
        f"three trainable matrices of shape d_in x d_out = ({d_in}, {d_out}), random until "
        "training settles them.",
        [
            ShapeCheck(n, (d_in, d_out), tuple(getattr(v1, n).shape), "d_in x d_out")
            for n in ("W_query", "W_key", "W_value")
        ],
        [Shown("W_query", v1.W_query.detach())],
        [],
    )


def _project_query(tr: Trace, one: QueryWalk, t: int, book_t: bool) -> Step:
    return Step(
        PART,
        f"Project the query: {tr.labels[t]!r} @ W_query",
        "Predict: queries, keys and values have one row per token and d_out columns; the "
        f"query is token {t} alone times W_query: {tr.dims.d_out} numbers.",
        shapes(tr, ("queries", "keys", "values")),
        [Shown("query", one.query)],
        [book("query", one.query)] if book_t else [],
    )


def _query_scores(tr: Trace, one: QueryWalk, t: int, book_t: bool) -> Step:
    keys = tr["keys"]
    own = torch.dot(one.query, keys[t])
    checks = [
        agree(
            f"the score of key {t} is query . keys[{t}]",
            own.reshape(1),
            one.scores[t].reshape(1),
            f"torch.dot(query, keys[{t}]) vs entry {t} of query @ keys.T",
            dot_rounding(keys[t : t + 1], one.query),
        ),
        Check(  # the query is projected alone here, with the others there: up to rounding
            "the query's row of the full score matrix equals its scores",
            one.scores_match,
            f"query @ keys.T vs row {t} of queries @ keys.T: max |difference| "
            f"{maxdiff(one.scores, tr['scores'][tr.row_index(t)]):.1e}",
        ),
    ]
    if book_t:
        checks.append(book("scores", one.scores))
    n = tr.dims.tokens
    return Step(
        PART,
        "Scores of this query: query @ keys.T",
        f"Predict: one raw score per key ({n}); key {t} is keys[{t}], not keys[{t + 1}].",
        [ShapeCheck("scores (one query)", (n,), tuple(one.scores.shape), "one per key")],
        [Shown("scores", one.scores, None, tr.labels)],
        checks,
    )


def _query_weights(tr: Trace, one: QueryWalk, book_t: bool) -> Step:
    checks = [rows_are_distributions(tr["weights"], logits(tr), rows=tr.rows)]
    if book_t:
        checks.append(book("weights", one.weights))
    n = tr.dims.tokens
    return Step(
        PART,
        f"Scale by sqrt(d_k) = sqrt({tr.dims.d_out}), then softmax",
        "Predict: positive weights that sum to 1, one per key; the ordering of the scores is kept.",
        [ShapeCheck("weights (one query)", (n,), tuple(one.weights.shape), "one per key")],
        [Shown("weights", one.weights, None, tr.labels)],
        checks,
    )


def _query_context(one: QueryWalk, book_t: bool) -> Step:
    d_out = one.context.shape[-1]
    return Step(
        PART,
        "Context vector of this query: weights @ values",
        f"Predict: {d_out} numbers, a weighted mix of the value rows.",
        [ShapeCheck("context (one query)", (d_out,), tuple(one.context.shape), "d_out numbers")],
        [Shown("context", one.context)],
        [book("context", one.context)] if book_t else [],
    )


def _every_token(tr: Trace, t: int, is_book: bool) -> Step:
    out, d_out = tr.result, tr.dims.d_out
    checks = [output_shape(out, tr.dims.tokens, d_out), walk_check(tr, t)]
    if is_book:
        checks.append(book("first row", out[0]))
    return Step(
        PART,
        "Every token at once: SelfAttentionV1(inputs)",
        f"Predict: every stage's shape from its rule{matrix_note(tr)}; the output has "
        f"{tr.dims.tokens} rows and {d_out} columns, and row {t} is the context vector just "
        "computed.",
        shapes(tr, tuple(tr.stages)),
        [show("weights", tr["weights"], tr, square=True), show("output", out, tr)],
        checks,
    )


def parameters_step(module: nn.Module, before: dict, x, labels, t, rows=None) -> Step:
    """The seed's distinction: weight parameters are read, attention weights are computed.

    ``rows``: a long input, whose weights of token ``t`` come from its row alone."""
    changed = [n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])]
    params = Check(
        "the forward pass reads the weight parameters and leaves them unchanged",
        not changed,
        "all parameters bit-for-bit equal after the forward pass"
        if not changed
        else f"changed: {', '.join(changed)}",
    )
    other = _other_input(module, x, rows)
    if rows is None:
        w1 = module.trace(x, labels=labels).walk(t).weights
        w2 = module.trace(other, labels=labels).walk(t).weights
    else:  # token t's row of weights, without the matrix
        w1 = row_stages(module, x, [t])["weights"][0]
        w2 = row_stages(module, other, [t])["weights"][0]
    shown = [Shown("weights(x)", w1, None, labels), Shown("weights(other)", w2, None, labels)]
    checks = [params]
    if x.shape[-2] > 1:  # one token always gets weight 1, whatever the input
        checks.append(
            Check(
                "the attention weights change with the input",
                not torch.allclose(w1, w2, atol=1e-6),
                f"token {t}'s weights for x and for another input: max |difference| "
                f"{maxdiff(w1, w2):.4f}",
            )
        )
    return Step(
        PART,
        "Weight parameters vs attention weights",
        "Predict: forward only reads W_query, W_key, W_value (training changes them), while "
        "the attention weights are computed afresh for every input: another input (random "
        "tokens, scaled so that their scores stay small) gets other weights.",
        [],
        shown,
        checks,
    )


def _other_input(module: nn.Module, x: torch.Tensor, rows=None) -> torch.Tensor:
    """Random tokens shaped like ``x`` whose scaled scores stay within [-1, 1] for ``module``
    (for a long input, the scores of the chosen ``rows``: the weights compared are theirs).

    Scaling ``x`` itself would not do: when its weights are one-hot (large scores), they
    stay one-hot at 2x or 0.5x. Small scores keep these weights well away from one-hot.
    """
    other = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    largest = forward_stages(module, other, rows)["scaled_scores"].abs().max().item()
    return other / largest**0.5 if largest > 1 else other  # scores are quadratic in x


def _v2(x: torch.Tensor, labels: tuple[str, ...], is_book: bool, seed: int, rows=None) -> Step:
    """V2 against V1; ``rows``: a long input, whose outputs are compared on those rows."""
    d_in = x.shape[-1]
    with seeded(seed):
        v2 = SelfAttentionV2(d_in, D_OUT)
    # In float64: float32 rounds x @ W.T and x @ W differently, and large scores
    # magnify that in the softmax; the claim is that the two compute the same thing.
    v2_64 = copy.deepcopy(v2).double()
    v1_64 = SelfAttentionV1.from_v2(v2_64)
    with torch.no_grad():
        if rows is None:
            out = v2(x)
            carried, out_64 = v1_64(x.double()), v2_64(x.double())
        else:  # the chosen rows of each output, without the matrix
            out = row_stages(v2, x, rows)["output"]
            carried = row_stages(v1_64, x.double(), rows)["output"]
            out_64 = row_stages(v2_64, x.double(), rows)["output"]
    n_rows = len(labels) if rows is None else len(rows)
    what = "" if rows is None else f" (rows {', '.join(map(str, rows))})"
    checks = [
        agree(
            "V1 carrying V2's weights (transposed) gives the same output",
            carried,
            out_64,
            f"SelfAttentionV1.from_v2(v2)(x) vs v2(x), in float64{what}",
        )
    ]
    if is_book:
        checks.append(book("v2 first row", out[0]))
    return Step(
        PART,
        "SelfAttentionV2: nn.Linear instead of nn.Parameter",
        f"torch.manual_seed({seed}); SelfAttentionV2(d_in={d_in}, d_out={D_OUT}). "
        "Predict: the same shapes, other numbers (nn.Linear starts from other random "
        f"values and stores its weight transposed, ({D_OUT}, {d_in})).",
        [
            ShapeCheck(
                "output" + what,
                (n_rows, D_OUT),
                tuple(out.shape),
                "one row per token" if rows is None else "one row per chosen token",
            ),
            ShapeCheck(
                "W_query.weight", (D_OUT, d_in), tuple(v2.W_query.weight.shape), "d_out x d_in"
            ),
        ],
        [Shown("output" + what, out, labels if rows is None else tuple(labels[r] for r in rows))],
        checks,
    )
