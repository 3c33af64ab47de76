"""Causal attention: hide the future, then dropout on the weights (``CausalAttention``)."""

from __future__ import annotations

import torch
from torch import nn

from ..lesson import Check, Shown, Step
from ..modules import CausalAttention
from ..trace import ShapeCheck, Trace, row_stages
from .checks import (
    BOOK_SEEDS,
    agree,
    book,
    hidden_rule,
    matrix_note,
    output_shape,
    rows_are_distributions,
    seeded,
    shapes,
    show,
    trace_rows,
    walk_check,
)

PART = "causal"
D_OUT = 2  # as in the book
DROPOUT = 0.5  # the book's demonstration of dropout
#: A long input checks the rows 0..q of a changed input when there are at most this many,
#: else rows 0 and q.
PROBE_ROWS = 64


def walk(
    x: torch.Tensor, labels: tuple[str, ...], t: int, is_book: bool, seed: int | None, rows=None
):
    """CausalAttention on ``x`` ``(T, d_in)``, context_length=T: ``(steps, trace)``;
    ``rows``: a row trace of those queries (a long input)."""
    s = BOOK_SEEDS["causal"] if seed is None else seed
    with seeded(s):
        ca = CausalAttention(x.shape[-1], D_OUT, context_length=x.shape[-2], dropout=0.0)
    ca.eval()
    tr = trace_rows(ca, x, labels, rows)
    steps = [
        _masked_scores(tr, s),
        _masked_weights(ca, tr, x),
        _output(ca, tr, x, t, is_book),
        _dropout(x.shape[-2], s, rows),
    ]
    return steps, tr


def _masked_scores(tr: Trace, seed: int) -> Step:
    masked, tokens = tr["masked_scores"], tr.dims.tokens
    hide = hidden_rule(tr)  # from positions, for the rows the trace keeps
    mask_ok = bool(torch.isneginf(masked[hide]).all() and torch.isfinite(masked[~hide]).all())
    return Step(
        PART,
        "Hide the future: masked_scores",
        f"torch.manual_seed({seed}); CausalAttention(d_in={tr.dims.d_in}, d_out={D_OUT}, "
        f"context_length={tokens}, dropout=0.0). Predict: the scaled scores with -inf "
        f"above the diagonal{matrix_note(tr)}: token i may look at tokens 0..i only.",
        shapes(tr, ("scores", "scaled_scores", "masked_scores")),
        [show("masked_scores", masked, tr, square=True)],
        [
            Check(
                "the masked scores are -inf exactly above the diagonal",
                mask_ok,
                f"{int(hide.sum())} future positions -inf, the other {int((~hide).sum())} finite",
            )
        ],
    )


def _masked_weights(ca: CausalAttention, tr: Trace, x: torch.Tensor) -> Step:
    weights = tr["weights"]
    if tr.rows is None or 0 in tr.rows:
        first, where = weights[tr.row_index(0)], "row 0 of the weights"
    else:  # a long input's row trace does not keep token 0: its row computed alone
        first, where = row_stages(ca, x, [0])["weights"][0], "row 0, computed alone"
    alone = torch.zeros_like(first)
    alone[0] = 1.0
    return Step(
        PART,
        "Weights: softmax over the visible keys",
        "Predict: zeros above the diagonal, each row still sums to 1; the first token "
        "can only attend to itself (weight 1).",
        shapes(tr, ("weights",)),
        [show("weights", weights, tr, square=True)],
        [
            rows_are_distributions(weights, tr["masked_scores"], causal=True, rows=tr.rows),
            Check(
                "the first token attends to itself alone (weight 1 on key 0)",
                bool(torch.equal(first, alone)),
                f"{where}: key 0 weight {float(first[0]):.4f}, the other "
                f"{first.numel() - 1:,} sum to {float(first[1:].sum()):.4f}",
            ),
        ],
    )


def _output(ca: CausalAttention, tr: Trace, x: torch.Tensor, t: int, is_book: bool) -> Step:
    out, tokens = tr.result, tr.dims.tokens
    checks = [output_shape(out, tokens, D_OUT), walk_check(tr, t)]
    if tokens > 1:
        q = t if t < tokens - 1 else 0  # a query with future tokens to change
        changed = x.clone()
        changed[q + 1 :] += 1.0
        if tr.rows is None:
            with torch.no_grad():
                out_changed, probe = ca(changed)[: q + 1], slice(0, q + 1)
            which = f"0..{q}"
        else:  # a long input: the rows 0..q (or the first and the last of them) alone
            probe = list(range(q + 1)) if q < PROBE_ROWS else [0, q]
            out_changed = row_stages(ca, changed, probe)["output"]
            which = f"0..{q}" if q < PROBE_ROWS else f"0 and {q}"
        checks.append(
            agree(
                f"changing the tokens after {q} leaves output rows {which} unchanged",
                out_changed,
                out[probe],
                f"tokens {q + 1}.. shifted by 1",
            )
        )
    if is_book:
        checks.append(book("causal first row", out[0]))
    return Step(
        PART,
        "Output: one context row per token",
        f"Predict: ({tokens}, {D_OUT}); row i depends on tokens 0..i only.",
        shapes(tr, ("context",)),
        [show("output", out, tr)],
        checks,
    )


def _dropout(tokens: int, seed: int, rows=None) -> Step:
    """Dropout on a matrix of ones, tokens x tokens; for a long input, the chosen ``rows``
    of it (dropout treats every entry alike)."""
    p = DROPOUT
    n = tokens if rows is None else len(rows)
    with seeded(seed):
        drop = nn.Dropout(p)
        ones = torch.ones(n, tokens)
        dropped = drop(ones)
    kept = dropped[dropped != 0]
    structure = bool(((dropped == 0) | (dropped == 1 / (1 - p))).all())
    drop.eval()
    identity = torch.equal(drop(ones), ones)
    return Step(
        PART,
        f"Dropout on the weights (training only), p={p}",
        f"torch.manual_seed({seed}); nn.Dropout({p}) on a matrix of ones"
        + ("" if rows is None else f", {n} rows of it ({n} x {tokens:,})")
        + ". Predict: about half "
        f"the entries become 0 and the rest become 1/(1-{p}) = {1 / (1 - p):g}, so the "
        "expected sum is unchanged; in eval mode nothing changes.",
        [ShapeCheck("dropped", (n, tokens), tuple(dropped.shape), "same shape as the input")],
        [Shown("dropout(ones)", dropped)],
        [
            Check(
                "dropout zeroes entries and scales the kept ones by 1/(1-p) in training mode",
                structure and kept.numel() > 0,
                f"{int((dropped == 0).sum())} zeros, {kept.numel()} kept, all equal to "
                f"{1 / (1 - p):g}: {structure}",
            ),
            Check(
                "dropout is the identity in eval mode",
                identity,
                "nn.Dropout.eval()(ones) equals ones" if identity else "eval mode changed it",
            ),
        ],
    )
