"""Mistakes after the weights: the context made the wrong way, heads merged wrongly, the
output projection skipped."""

from __future__ import annotations

from ...stages import Stage
from ..reference import Mutation, merge
from .base import Context, Evidence, define


def _context_unseen(ev: Evidence) -> bool:
    """Weights and values both right, and no context made of them."""
    return ev.user is None and bool(ev.found.get(Stage.WEIGHTS) and ev.found.get(Stage.VALUES))


@define(
    "context_wrong_product",
    expected="expected weights @ values: context_i = sum_j w_ij value_j",
    recognise=_context_unseen,
)
def _context_wrong_product(c: Context) -> list[Mutation]:
    return [
        Mutation(
            "context_wrong_product",
            Stage.CONTEXT,
            "weights transposed: weights^T @ values",
            context=lambda w, v: w.mT @ v,
        ),
        Mutation(
            "context_wrong_product",
            Stage.CONTEXT,
            "weights summed over keys times values",
            context=lambda w, v: w.sum(-1, keepdim=True) * v,
        ),
        Mutation(
            "context_wrong_product",
            Stage.CONTEXT,
            "weights times the keys: weights @ keys, not weights @ values",
            values_as_keys=True,
        ),
    ]


@define("heads_merge", expected="expected context.transpose(1, 2).reshape(b, tokens, d_out)")
def _heads_merge(c: Context) -> list[Mutation]:
    if not (c.spec.multihead and c.spec.num_heads > 1):
        return []
    merges = {
        "heads merged without moving the head axis back (mixes tokens)": lambda t: t.reshape(
            t.shape[0], t.shape[2], -1
        ),
        # a tokens-first layer (fairseq's (T, B*H, hd) bmm layout) viewing its
        # (B*H, T, hd) context as (T, B, d_out) without the transpose
        "heads merged tokens first without moving the head axis back (mixes tokens and "
        "sequences)": lambda t: t.reshape(t.shape[2], t.shape[0], -1).transpose(0, 1),
        # a channels-first layer (VITS's (b, d, t)) viewing its (B, H, T, hd) context as
        # (B, d, T) without the transpose
        "heads merged channels first without moving the head axis back (mixes tokens and "
        "features)": lambda t: t.reshape(t.shape[0], -1, t.shape[2]).transpose(1, 2),
        "heads merged feature-interleaved": lambda t: t.permute(0, 2, 3, 1).reshape(
            t.shape[0], t.shape[2], -1
        ),
        "heads concatenated in reverse order": lambda t: merge(t.flip(1)),
        "heads averaged instead of concatenated": lambda t: t.mean(1),
        "heads summed instead of concatenated": lambda t: t.sum(1),
    }
    return [Mutation("heads_merge", Stage.OUTPUT, label, merge=fn) for label, fn in merges.items()]


@define("missing_out_proj", expected="expected the output projection applied to the merged heads")
def _missing_out_proj(c: Context) -> list[Mutation]:
    if not c.spec.has_out:
        return []
    return [
        Mutation("missing_out_proj", Stage.OUTPUT, "output projection not applied", skip_out=True)
    ]
