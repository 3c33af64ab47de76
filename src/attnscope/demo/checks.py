"""The checks every part of the demo makes, and the book's printed numbers they compare with."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ..formatting import format_values
from ..lesson import Check, Shown
from ..trace import ShapeCheck, Trace, Traceable, row_stages, trace

#: The seeds the book uses: V1, causal and multi-head with 123, V2 with 789.
BOOK_SEEDS = {"self": 123, "v2": 789, "causal": 123, "multihead": 123, "causal-multihead": 123}
#: The book's query: token 1, "journey".
BOOK_TOKEN = 1
#: From this many tokens on, the demo walks every part with row traces: the matrix stages
#: keep the query's row (and the last token's) only, everything else is computed block by
#: block without a tokens x tokens matrix (one is 4 MB per head at 1024 tokens, and its
#: pictures are pooled anyway).
LONG_TOKENS = 1024
#: The blocks (of queries and of keys) a long input's row traces compute the context over.
LONG_BLOCK = 512
#: Scores further than this below their row's largest get a softmax weight that may
#: underflow float32 to exactly 0 (exp(-80) is about 1.8e-35; exp(-104) is 0).
EXP_RANGE = 80.0

# The book's printed numbers (4 decimals), shown beside ours when the demo runs the book's
# example; the per-token ones are for the book's query, token 1 ("journey").
_BOOK = {
    "simplified scores": [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    "simplified sum": [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656],
    "simplified softmax": [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    "simplified context": [0.4419, 0.6515, 0.5683],
    "toy sum": [0.125, 0.625, 0.25],
    "toy softmax": [0.0171, 0.9362, 0.0466],
    "query": [0.4306, 1.4551],
    "scores": [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440],
    "weights": [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820],
    "context": [0.3061, 0.8210],
    "first row": [0.2996, 0.8053],
    "v2 first row": [-0.0739, 0.0713],
    "causal first row": [-0.4519, 0.2216],
    "multihead first row": [0.3190, 0.4858],
}


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` inside, the caller's RNG state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def agree(
    name: str, a: torch.Tensor, b: torch.Tensor, what: str, atol: float | torch.Tensor = 1e-6
) -> Check:
    """``a`` equals ``b`` to ``rtol=1e-5`` and ``atol`` (a number, or one per entry)."""
    ok = a.shape == b.shape and bool(
        ((a.double() - b.double()).abs() <= atol + 1e-5 * b.double().abs()).all()
    )
    diff = f"max |difference| {maxdiff(a, b):.1e}" if a.shape == b.shape else "shapes differ"
    return Check(name, ok, f"{what}: {diff}")


def dot_rounding(rows: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """How far two ways of summing ``rows @ vector`` may differ by rounding alone.

    Summing ``n`` products in any order is within ``n * eps`` (to first order) times the
    sum of their absolute values of the exact sum, so two orders are within twice that.
    """
    eps = torch.finfo(rows.dtype).eps
    n = rows.shape[-1]
    return 2 * n * eps / (1 - n * eps) * (rows.abs() @ vector.abs()).double() + 1e-6


def book(name: str, actual: torch.Tensor) -> Check:
    """``actual`` against the book's printed numbers ``name`` (4 decimals)."""
    expected = torch.tensor(_BOOK[name], dtype=torch.float64)
    got = actual.detach().double().flatten()
    # The book prints 4 decimals: agree to the rounding.
    ok = got.shape == expected.shape and bool((got - expected).abs().max() <= 6e-5)
    detail = f"book {format_values(expected)}" + ("" if ok else f"; got {format_values(got)}")
    return Check(f"matches the book: {name}", ok, detail)


def rows_are_distributions(
    weights: torch.Tensor,
    logits: torch.Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    rows: Sequence[int] | None = None,
) -> Check:
    """Weights positive (zero exactly on masked keys when causal, and outside a sliding
    ``window``) and each row sums to 1.

    ``logits`` are what the softmax was given: a weight whose logit is more than
    :data:`EXP_RANGE` below its row's largest may underflow float32 to exactly 0, so it
    must only be >= 0. Without ``logits`` every weight must be positive. ``rows``: a row
    trace's query positions (the weights hold those rows only).
    """
    if causal:
        queries = torch.tensor(rows) if rows is not None else torch.arange(weights.shape[-2])
        back = queries[:, None] - torch.arange(weights.shape[-1])[None, :]  # (rows, keys)
    w = weights.double()
    sums_ok = torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-5)
    if logits is None:
        representable = torch.ones_like(w, dtype=torch.bool)
    else:
        representable = logits > logits.max(-1, keepdim=True).values - EXP_RANGE
    sign_ok = bool((w >= 0).all() and (w[representable] > 0).all())
    if causal and window is not None:
        hidden = (back < 0) | (back >= window)
        sign_ok = sign_ok and bool((w[..., hidden] == 0).all())
        name = (
            f"weights are zero above the diagonal and outside the window of {window}, "
            "positive elsewhere, and each row sums to 1"
        )
    elif causal:
        above = back < 0
        sign_ok = sign_ok and bool((w[..., above] == 0).all())
        name = "weights are zero above the diagonal, positive elsewhere, and each row sums to 1"
    else:
        name = "weights are positive and each row sums to 1"
    worst = (w.sum(-1) - 1).abs().max().item()
    detail = f"min weight {w.min().item():.4f}; max |row sum - 1| {worst:.1e}"
    underflow = 0 if logits is None else int((~representable & torch.isfinite(logits)).sum())
    if underflow:
        detail += (
            f"; {underflow} scores more than {EXP_RANGE:g} below their row's largest may "
            "get weight exactly 0 (exp underflows float32)"
        )
    return Check(name, sums_ok and sign_ok, detail)


def logits(tr: Trace) -> torch.Tensor:
    """What the trace's softmax was given: masked, else biased, else scaled, else raw scores."""
    for name in ("masked_scores", "biased_scores", "scaled_scores", "scores"):
        if name in tr:
            return tr[name]
    raise AssertionError("every trace has scores")


def output_shape(out: torch.Tensor, tokens: int, d_out: int) -> Check:
    want = (*out.shape[:-2], tokens, d_out)
    return Check(
        "the output has one row per token and d_out columns",
        tuple(out.shape) == want,
        f"{tokens} tokens, d_out={d_out}: expected {want}, got {tuple(out.shape)}",
    )


def walk_check(tr: Trace, token: int) -> Check:
    """The seed's single-query computation equals its row of the batched one."""
    walk = tr.walk(token)
    return Check(
        "the single-token context vector equals its row of the batched output",
        walk.matches,
        f"token {token} ({walk.label!r}) alone: {format_values(walk.context)}; "
        f"batched row {token}: {format_values(walk.batched_context)}; "
        f"max |difference| {walk.max_abs_diff:.1e}",
    )


def shapes(tr: Trace, names: Sequence[str]) -> list[ShapeCheck]:
    """The trace's predicted-against-actual shapes of the stages ``names``."""
    return [c for c in tr.shape_checks() if c.name in names]


def show(name: str, t: torch.Tensor, tr: Trace, square: bool = False) -> Shown:
    """Show ``t`` with token labels on its rows (and columns, for a tokens x tokens matrix)."""
    if t.dim() < 2:
        cols = tr.labels if t.shape[-1] == tr.dims.tokens and square else None
        return Shown(name, t, None, cols)
    return Shown(name, t, row_labels(tr) if square else tr.labels, tr.labels if square else None)


# --- long inputs: row traces ---------------------------------------------------------------------


def demo_rows(tokens: int, token: int) -> tuple[int, ...] | None:
    """The query rows the demo traces: ``None`` (every row) below :data:`LONG_TOKENS`
    tokens, else the query ``token`` and the last token."""
    if tokens < LONG_TOKENS:
        return None
    return (token,) if token == tokens - 1 else (token, tokens - 1)


def trace_rows(
    target: Traceable | str, x: torch.Tensor, labels: Sequence[str], rows: Sequence[int] | None
) -> Trace:
    """A part's trace of ``target`` (a module, or ``"simplified"``): full when ``rows`` is
    None, else a row trace of those queries whose summary is left for later (the demo's
    steps never read it; an HTML report computes it on first use)."""
    if rows is None:
        if isinstance(target, str):
            return trace(target, x, labels=labels)
        return target.trace(x, labels=labels)
    return trace(target, x, labels=labels, rows=rows, block=LONG_BLOCK, summary=False)


def rows_of(tr: Trace, tensor: torch.Tensor) -> torch.Tensor:
    """The chosen rows of a per-token tensor ``(..., T, d)`` of ``tr`` (the rows its matrix
    stages keep); the tensor itself for a full trace."""
    return tensor if tr.rows is None else tensor[..., list(tr.rows), :]


def query_positions(tr: Trace) -> torch.Tensor:
    """``(R,)`` the query position of every row of ``tr``'s matrix stages."""
    if tr.rows is None:
        return torch.arange(tr.dims.tokens)
    return torch.tensor(tr.rows)


def hidden_rule(tr: Trace, window: int | None = None) -> torch.Tensor:
    """``(R, T)`` True where the causal mask (and a sliding ``window``) hides key ``j`` from
    the query of row ``r``: built from positions alone, for the rows ``tr`` keeps."""
    back = query_positions(tr)[:, None] - torch.arange(tr.dims.tokens)[None, :]
    hidden = back < 0
    return hidden if window is None else hidden | (back >= window)


def row_labels(tr: Trace) -> tuple[str, ...]:
    """The labels of the rows of ``tr``'s matrix stages; a row trace's with their positions
    where the label is not the position itself (``journey (1)``)."""
    if tr.rows is None:
        return tr.labels
    return tuple(
        tr.labels[r] if tr.labels[r] == str(r) else f"{tr.labels[r]} ({r})" for r in tr.rows
    )


def forward_stages(
    module: Traceable, x: torch.Tensor, rows: Sequence[int] | None
) -> dict[str, torch.Tensor]:
    """Another forward pass of ``module`` on ``x``, as stages: a full trace's (and
    ``output``) when ``rows`` is None, else :func:`~attnscope.trace.row_stages` of those
    rows (context and output of those rows only, no tokens x tokens matrix)."""
    if rows is not None:
        return row_stages(module, x, rows)
    tr = module.trace(x)
    return {**tr.stages, "output": tr.result}


def matrix_note(tr: Trace) -> str:
    """For a row trace, what a tokens x tokens matrix stage holds instead ("" otherwise)."""
    if tr.rows is None:
        return ""
    names = " and ".join(f"{r} ({tr.labels[r]!r})" for r in tr.rows)
    return (
        f" (with {tr.dims.tokens:,} tokens only the rows of queries {names} are kept, "
        f"{len(tr.rows)} x {tr.dims.tokens:,}, computed without the matrix; every context "
        "row is computed block by block)"
    )
