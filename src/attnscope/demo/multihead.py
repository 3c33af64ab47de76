"""Multi-head attention (the book's ``MultiHeadAttention``), with or without the causal mask."""

from __future__ import annotations

import torch

from ..lesson import Shown, Step
from ..modules import MultiHeadAttention
from ..trace import Trace
from .checks import (
    BOOK_SEEDS,
    agree,
    book,
    logits,
    matrix_note,
    output_shape,
    rows_are_distributions,
    seeded,
    shapes,
    show,
    trace_rows,
    walk_check,
)

D_OUT, HEADS = 2, 2  # as in the book


def walk(x, labels, t, is_book, seed, causal=False, rows=None):
    """MultiHeadAttention on ``x`` ``(T, d_in)``: d_out=2, 2 heads: ``(steps, trace)``.

    ``causal`` is the book's layer; without it every token sees every token. ``rows``: a
    row trace of those queries (a long input).
    """
    part = "causal-multihead" if causal else "multihead"
    s = BOOK_SEEDS[part] if seed is None else seed
    with seeded(s):
        mha = MultiHeadAttention(
            x.shape[-1], D_OUT, x.shape[-2], 0.0, num_heads=HEADS, causal=causal
        )
    mha.eval()
    tr = trace_rows(mha, x, labels, rows)
    steps = [
        _split_heads(tr, part, s, causal),
        _per_head(tr, part, t, causal),
        _merge(mha, tr, x, part, t, is_book and causal),  # the book prints the causal one's
    ]
    return steps, tr


def _split_heads(tr: Trace, part: str, seed: int, causal: bool) -> Step:
    d, head_dim = tr.dims, D_OUT // HEADS
    which = "causal as in the book" if causal else "no mask: every token sees every token"
    return Step(
        part,
        "Split d_out into heads",
        f"torch.manual_seed({seed}); MultiHeadAttention(d_in={d.d_in}, d_out={D_OUT}, "
        f"context_length={d.tokens}, dropout=0.0, num_heads={HEADS}"
        f"{'' if causal else ', causal=False'}), {which}. "
        f"Predict: {HEADS} heads of head_dim = {D_OUT} // {HEADS} = {head_dim}: queries, keys "
        f"and values become ({HEADS}, {d.tokens}, {head_dim}).",
        shapes(tr, ("queries", "keys", "values")),
        [],
        [],
    )


def _per_head(tr: Trace, part: str, t: int, causal: bool) -> Step:
    tokens = tr.dims.tokens
    mask_text = ", future keys masked" if causal else ""
    return Step(
        part,
        "Each head attends on its own",
        f"Predict: per head a tokens x tokens matrix: ({HEADS}, {tokens}, {tokens})"
        f"{matrix_note(tr)}, each head's rows summing to 1, scaled by sqrt(head_dim)"
        f"{mask_text}.",
        shapes(tr, ("scores", "scaled_scores", "masked_scores", "weights")),
        [
            Shown(
                f"weights of token {t}, per head",
                tr.walk(t).weights,
                tuple(f"head {h}" for h in range(HEADS)),
                tr.labels,
            )
        ],
        [rows_are_distributions(tr["weights"], logits(tr), causal=causal, rows=tr.rows)],
    )


def _merge(
    mha: MultiHeadAttention, tr: Trace, x: torch.Tensor, part: str, t: int, is_book: bool
) -> Step:
    with torch.no_grad():
        fast = mha(x)  # use_fast_path: scaled_dot_product_attention
    checks = [
        output_shape(tr.result, tr.dims.tokens, D_OUT),
        walk_check(tr, t),
        agree(
            "the fast path (scaled_dot_product_attention) equals the explicit stages",
            fast,
            tr.result,
            "fused vs explicit output",
            atol=1e-5,
        ),
    ]
    if is_book:
        checks.append(book("multihead first row", tr.result[0]))
    head_dim = D_OUT // HEADS
    return Step(
        part,
        "Merge the heads and project: out_proj",
        f"Predict: contexts ({HEADS}, {tr.dims.tokens}, {head_dim}) concatenate back to "
        f"({tr.dims.tokens}, {D_OUT}), then out_proj mixes the heads.",
        shapes(tr, ("context", "output")),
        [show("output", tr.result, tr)],
        checks,
    )
