"""The predict-then-check walk through the pipeline, as data (the CLI prints it).

:func:`run_demo` follows the seeds: pick a query, score it against every token (a loop and
``torch.dot`` agree), normalise the scores (by the sum, by a naive and a stable softmax),
then do the same with trainable weights (``SelfAttentionV1``), one query alone and then all
at once; causal masking and multi-head attention (without and with the causal mask) on
request; then modern attention: rotary position embeddings and grouped-query attention
(``GroupedQueryAttention`` with its window and ALiBi). Every step says what to predict,
records the predicted and actual shapes, the tensors to show, and the checks that the seeds
name (see :mod:`attnscope.lesson`). With the defaults it reproduces the book's printed
numbers.

One module per part, each a list of short steps: :mod:`.simplified`, :mod:`.self_attention`,
:mod:`.causal`, :mod:`.multihead`, :mod:`.rope`, :mod:`.gqa`; :mod:`.checks` holds what
they share.
:func:`make_trace` and :func:`trace_checks` serve ``attnscope trace`` and ``plot``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from ..errors import AttnScopeError, check_embeddings, check_labels, check_seed, check_token_index
from ..examples import BOOK_TOKENS, book_embeddings
from ..grouped import GroupedQueryAttention
from ..lesson import Check, DemoResult, Shown, Step
from ..modules import CausalAttention, MultiHeadAttention, SelfAttentionV1
from ..trace import Trace, trace
from . import causal, gqa, multihead, rope, self_attention, simplified
from . import checks as _checks
from .checks import BOOK_SEEDS, logits, rows_are_distributions, seeded, walk_check

__all__ = [
    "BOOK_SEEDS",
    "DEMO_KINDS",
    "GQA_DEFAULTS",
    "TRACE_KINDS",
    "Check",
    "DemoResult",
    "Shown",
    "Step",
    "default_token",
    "make_trace",
    "run_demo",
    "trace_checks",
]

#: The demo's parts, in the order ``"all"`` walks them (``None`` walks simplified then self).
#: As everywhere in attnscope, ``multihead`` has no causal mask and ``causal-multihead``
#: is the book's (causal) ``MultiHeadAttention``; ``rope`` and ``gqa`` walk modern attention
#: (rotary position embeddings; grouped key/value heads, windows, ALiBi).
DEMO_KINDS = ("simplified", "self", "causal", "multihead", "causal-multihead", "rope", "gqa")
#: What ``attnscope trace`` and ``plot`` can build (``gqa``: a GroupedQueryAttention).
TRACE_KINDS = ("simplified", "self", "causal", "multihead", "causal-multihead", "gqa")
#: ``gqa``'s sizes when none are given: 16 features in 4 heads of 4 (with two kv heads), as
#: in the demo's part.
GQA_DEFAULTS = {"d_out": gqa.D_OUT, "heads": gqa.HEADS}

#: The walks with trainable weights, by part: ``(x, labels, token, book, seed) -> (steps, trace)``.
_WALKS = {
    "self": self_attention.walk,
    "causal": causal.walk,
    "multihead": multihead.walk,
    "causal-multihead": partial(multihead.walk, causal=True),
    "rope": rope.walk,
    "gqa": gqa.walk,
}


def default_token(
    tokens: int, token: int | None, *, name: str = "token", negative: bool = True
) -> int:
    """``token`` checked against ``tokens``; by default the seed's second token (1), or 0.

    Negative positions count from the end unless ``negative=False`` (the CLI's ``--token``).
    """
    if token is None:
        return 1 if tokens > 1 else 0
    return check_token_index(token, tokens, name=name, negative=negative)


def run_demo(
    kind: str | None = None,
    *,
    x: torch.Tensor | None = None,
    labels: Sequence[str] | None = None,
    token: int | None = None,
    seed: int | None = None,
) -> DemoResult:
    """Walk the pipeline, predict then check, and return every step.

    Args:
        kind: one of :data:`DEMO_KINDS` for one part (``"multihead"`` without the causal
            mask, ``"causal-multihead"`` the book's), ``"all"`` for all of them in that
            order, ``None`` for simplified then self (the seeds' walk).
        x: ``(tokens, d_in)`` embeddings; the book's six by default.
        labels: one per token (made text with ``str``); the book's words for the book's
            embeddings.
        token: the query position (default 1, the book's "journey", or 0 for one token);
            negative positions count from the end.
        seed: the seed for every module; by default the book's (123, and 789 for V2).

    From :data:`~attnscope.demo.checks.LONG_TOKENS` tokens on, every part walks row traces
    (the query's row and the last token's): no step builds a tokens x tokens matrix, and
    each check works on those rows, on positions, or on whole (linear) outputs.

    Returns:
        a :class:`DemoResult`; ``.ok`` says whether every check passed.
    """
    if kind is None:
        parts: tuple[str, ...] = ("simplified", "self")
    elif kind == "all":
        parts = DEMO_KINDS
    elif kind in DEMO_KINDS:
        parts = (kind,)
    else:
        raise AttnScopeError(
            f"kind: expected one of {', '.join(DEMO_KINDS)} or 'all', got {kind!r}"
        )
    if seed is not None:
        check_seed(seed)
    book = x is None and seed is None
    if x is None:
        x = book_embeddings()
        labels = BOOK_TOKENS if labels is None else labels
    x = check_embeddings(x, name="inputs", ranks=(2,)).float()
    tokens = x.shape[0]
    labels = tuple(str(i) for i in range(tokens)) if labels is None else labels
    labels = check_labels(labels, tokens)
    t = default_token(tokens, token)
    # a long input: every part walks row traces of the query (and the last token)
    rows = _checks.demo_rows(tokens, t)

    steps: list[Step] = []
    traces: dict[str, Trace] = {}
    with torch.no_grad():
        for part in parts:
            if part == "simplified":
                new, tr = simplified.walk(x, labels, t, book, rows=rows)
            else:
                new, tr = _WALKS[part](x, labels, t, book, seed, rows=rows)
            steps += new
            traces[part] = tr
    return DemoResult(steps, traces, t, book)


# --- attnscope trace / plot -------------------------------------------------------------------


def make_trace(
    kind: str,
    x: torch.Tensor,
    *,
    labels: Sequence[str] | None = None,
    seed: int = 123,
    d_out: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    window: int | None = None,
    alibi: bool = False,
    rows: Sequence[int] | None = None,
) -> Trace:
    """Build the reference module of ``kind`` with ``seed`` and trace it on ``x``.

    Args:
        kind: one of :data:`TRACE_KINDS`. ``self`` is ``SelfAttentionV1``; ``causal`` is
            ``CausalAttention``; ``multihead``/``causal-multihead`` are ``MultiHeadAttention``
            without/with the causal mask; ``gqa`` is a causal ``GroupedQueryAttention`` (RoPE
            unless ``alibi``). Dropout is 0 and modules are in eval mode.
        x: ``(tokens, d_in)`` or ``(batch, tokens, d_in)``.
        d_out, heads: output features and (query) heads (``heads`` for the multi-head kinds
            and gqa only); by default 2 and 2, for gqa 16 and 4.
        kv_heads, window, alibi: gqa only: key/value heads (default half of ``heads``, or
            ``heads`` when that is odd), a sliding window, ALiBi instead of RoPE.
        rows: a row trace of these query positions (see :func:`attnscope.trace`).
    """
    if kind not in TRACE_KINDS:
        raise AttnScopeError(f"kind: expected one of {', '.join(TRACE_KINDS)}, got {kind!r}")
    check_seed(seed)
    x = check_embeddings(x, name="inputs")
    if kind != "gqa" and (kv_heads is not None or window is not None or alibi):
        given = [
            f"{name}={value}"
            for name, value in (("kv_heads", kv_heads), ("window", window), ("alibi", alibi))
            if value not in (None, False)
        ]
        raise AttnScopeError(
            f"{', '.join(given)}: expected only with kind 'gqa' (GroupedQueryAttention), "
            f"got kind {kind!r}"
        )
    if kind == "simplified":
        return trace("simplified", x, labels=labels, rows=rows)
    d_in, tokens = x.shape[-1], x.shape[-2]
    if kind == "gqa":
        d_out = GQA_DEFAULTS["d_out"] if d_out is None else d_out
        heads = GQA_DEFAULTS["heads"] if heads is None else heads
        if kv_heads is None:
            kv_heads = heads // 2 if heads % 2 == 0 else heads
        if not alibi and d_out // heads < 2 and d_out % heads == 0:
            raise AttnScopeError(
                f"d_out: expected at least 2 features per head for rotary embeddings (one "
                f"pair to turn), got d_out={d_out} in {heads} heads; give a larger d_out, or "
                "ALiBi instead"
            )
    d_out = 2 if d_out is None else d_out
    heads = 2 if heads is None else heads
    with seeded(seed):
        if kind == "self":
            module: nn.Module = SelfAttentionV1(d_in, d_out)
        elif kind == "causal":
            module = CausalAttention(d_in, d_out, context_length=tokens, dropout=0.0)
        elif kind == "gqa":
            module = GroupedQueryAttention(d_in, d_out, heads, kv_heads, window=window, alibi=alibi)
        else:
            module = MultiHeadAttention(
                d_in, d_out, tokens, 0.0, num_heads=heads, causal=kind == "causal-multihead"
            )
    module.eval()
    return module.trace(x, labels=labels, rows=rows)


def trace_checks(tr: Trace, token: int) -> list[Check]:
    """The checks ``attnscope trace`` reports: shapes, weights, and the single-query walk."""
    bad = [c for c in tr.shape_checks() if not c.ok]
    checks = [
        Check(
            "every stage has its predicted shape",
            not bad,
            f"{len(tr.stages)} stages"
            if not bad
            else f"differs: {', '.join(str(c.stage) for c in bad)}",
        ),
        rows_are_distributions(
            tr["weights"],
            logits(tr),
            causal="masked_scores" in tr,
            window=getattr(tr.module, "window", None),
            rows=tr.rows,
        ),
        walk_check(tr, token),
    ]
    return checks
