"""The mistake codes: a public contract, and everything the checker knows of each.

Every code has one home. The contract (code, the stages where it shows first, its meaning)
is listed here in the order of ``check-report.schema.json``; what the checker does with it
lives beside its neighbours in the pipeline (:mod:`.projections`, :mod:`.scores`,
:mod:`.masks`, :mod:`.weights`, :mod:`.output`), attached by :func:`define`:

- ``mutate``: the reference with that one mistake made (:class:`..reference.Mutation`), so
  that a user's output the mutation reproduces names the mistake;
- ``recognise``: what a user's own tensor at that stage looks like with the mistake, when no
  mutation reproduces the output exactly;
- ``expected``: the sentence that says what was expected instead.

Modern codes (grouped heads, rotary positions, QK norm, windows, position biases,
cross-attention) are in the contract; they gain behaviour with modern attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...stages import Stage
from ..reference import Mutation

# each module attaches the behaviour of the codes of its part of the pipeline
from . import masks, modern, output, projections, scores, weights  # noqa: F401
from .base import MISTAKES, Context, Evidence, Mistake, define

__all__ = [
    "MISTAKES",
    "Mistake",
    "Context",
    "Evidence",
    "catalogue",
    "recognise",
    "define",
    "one_query_mutations",
]

T = torch.Tensor


def catalogue(ctx: Context) -> list[Mutation]:
    """Every known single mistake that applies to ``ctx``, in pipeline order."""
    return [mut for m in MISTAKES.values() if m.mutate is not None for mut in m.mutate(ctx)]


def recognise(stage: Stage, ev: Evidence) -> str:
    """The code whose recogniser knows the user's tensor at ``stage``, else ``other``."""
    for m in MISTAKES.values():
        if stage in m.stages and m.recognise is not None and m.recognise(ev):
            return m.code
    return "other"


def one_query_mutations() -> list[tuple[str, Stage, str, Callable[[T, int], T]]]:
    """Mistakes of ``f(inputs, query_index) -> (T,)``: (code, stage, label, fn)."""
    return [
        (m.code, stage, label, fn)
        for m in MISTAKES.values()
        if m.one_query is not None
        for stage, label, fn in m.one_query()
    ]
