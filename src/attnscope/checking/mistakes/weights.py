"""Mistakes in turning scores into weights: the wrong axis, not a softmax, a softmax that
overflows, the mask applied after it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...stages import Stage
from ..compare import close
from ..reference import Mutation, causal_hide, window_hide
from .base import Context, Evidence, define

T = torch.Tensor
_W = Stage.WEIGHTS


def _finite_mask(fill: float) -> Callable[[T], T]:
    """The causal mask with a finite fill (-1e9): wrong-axis softmaxes then differ from -inf."""
    return lambda s: s.masked_fill(causal_hide(s.shape[-1]), fill)


def _softmax_elsewhere(ev: Evidence) -> bool:
    """The user's weights are a softmax of the right logits over another axis."""
    logits = ev.ref.get("masked_scores", ev.ref.get("scaled_scores", ev.ref["scores"]))
    if ev.user is None or ev.user.shape != logits.shape:
        return False
    finite = logits.nan_to_num(neginf=-1e9)  # the user's fill may be finite
    return any(close(ev.user, torch.softmax(finite, dim=d)) for d in range(logits.dim() - 1))


@define(
    "softmax_wrong_dim",
    expected="expected softmax over the keys, dim=-1, so each query's weights sum to 1",
    recognise=_softmax_elsewhere,
)
def _softmax_wrong_dim(c: Context) -> list[Mutation]:
    axes = [(-2, "the queries (dim=-2)", None), (0, "dim=0", 0), (1, "dim=1", 1)]
    if c.spec.multihead:
        axes.append((2, "dim=2", 2))
    out = []
    for dim, text, user_dim in axes:
        for fill in (None, -1e9) if c.spec.causal else (None,):
            out.append(
                Mutation(
                    "softmax_wrong_dim",
                    _W,
                    f"softmax over {text} instead of the keys (dim=-1)",
                    mask=None if fill is None else _finite_mask(fill),
                    softmax=lambda s, d=dim: torch.softmax(s, dim=d),
                    user_dim=user_dim,
                    facts={"dim": dim},
                )
            )
    out.append(
        Mutation(
            "softmax_wrong_dim",
            _W,
            "softmax over the whole score matrix at once instead of each query's row",
            softmax=lambda s: torch.softmax(s.flatten(-2), dim=-1).view_as(s),
        )
    )
    return out


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its infinities (a column every query hides) read as 0."""
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


@define(
    "not_softmax",
    expected="expected torch.softmax(scaled_scores, dim=-1)",
    recognise=lambda ev: True,  # the fallback at the weights
)
def _not_softmax(c: Context) -> list[Mutation]:
    forms = {
        "scores divided by their row sum": lambda s: s / s.sum(-1, keepdim=True),
        "sigmoid": torch.sigmoid,
        "no normalisation": lambda s: s,
        "a softmax of the softmax (applied twice)": lambda s: torch.softmax(
            torch.softmax(s, dim=-1), dim=-1
        ),
        # F.softmin for F.softmax: a softmax of the negated scores, where the hidden keys
        # (a finite fill, negated) take every weight
        "softmin: a softmax of the negated scores": lambda s: torch.softmax(
            -s.clamp_min(-1e30), dim=-1
        ),
        "exp without normalising": torch.exp,
        # a hand-written stable softmax that never divides by the row sum
        "exp of the scores less their row maximum, never divided by the row sum": (
            lambda s: torch.exp(s - _finite(s.amax(-1, keepdim=True)))
        ),
        "log_softmax": lambda s: torch.log_softmax(s, dim=-1),
        "relu divided by the row sum": lambda s: s.relu() / s.relu().sum(-1, keepdim=True),
        # F.normalize in the softmax's place (p=1: the absolute row sum; its default p=2)
        "scores divided by their row's L1 norm (F.normalize, p=1)": lambda s: (
            s / s.abs().sum(-1, keepdim=True).clamp_min(1e-12)
        ),
        "scores divided by their row's L2 norm (F.normalize)": lambda s: (
            s / s.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        ),
        "masked scores set to 0 and divided by the row sum": lambda s: (
            s.nan_to_num(neginf=0.0) / s.nan_to_num(neginf=0.0).sum(-1, keepdim=True)
        ),
        # a hand-written stable softmax whose maximum is each key's, over the queries: every
        # column shifted by its own amount, so each row is no longer a softmax of its scores
        "a softmax of the scores less each key's maximum over the queries (amax dim=-2)": (
            lambda s: torch.softmax(s - _finite(s.amax(-2, keepdim=True)), dim=-1)
        ),
    }
    return [Mutation("not_softmax", _W, label, softmax=fn) for label, fn in forms.items()]


# unstable_softmax agrees with the reference on normal inputs: the judge finds it with a
# probe at large magnitude (Judge._large_probe), or where exp() is the first op to overflow
define(
    "unstable_softmax",
    expected="expected a softmax that stays finite: subtract each row's maximum before exp, "
    "or use torch.softmax",
)


@define(
    "mask_after_softmax",
    expected="expected the mask on the scores before the softmax, so each row of weights "
    "still sums to 1",
)
def _mask_after_softmax(c: Context) -> list[Mutation]:
    if not c.spec.causal:
        return []
    w = c.spec.window
    # softmax over the unmasked scores, then the mask on the weights
    out = [
        Mutation(
            "mask_after_softmax",
            _W,
            "weights zeroed above the diagonal after the softmax, rows not renormalised",
            mask=lambda s: s,
            after_softmax=lambda w: w.masked_fill(causal_hide(w.shape[-1]), 0.0),
        ),
    ]
    if w is not None and w < c.tokens:
        out.append(
            Mutation(
                "mask_after_softmax",
                _W,
                f"weights zeroed outside the causal window of {w} after the softmax, rows not "
                "renormalised",
                mask=lambda s: s,
                after_softmax=lambda t: t.masked_fill(window_hide(t.shape[-1], w), 0.0),
            )
        )
    alibi = c.spec.position_bias
    if alibi is not None:
        # the future split off a combined ALiBi-and-causal mask (Baichuan's ``isinf``):
        # the later keys' scores go into the softmax with no bias, then are zeroed
        def unbiased_future(h, n):
            b = alibi.bias(h, n)
            return None if b is None else b.masked_fill(causal_hide(n), 0.0)

        out.append(
            Mutation(
                "mask_after_softmax",
                _W,
                "weights zeroed above the diagonal after the softmax, rows not renormalised "
                "(the later keys' scores taken in without their position bias)",
                mask=lambda s: s,
                after_softmax=lambda w: w.masked_fill(causal_hide(w.shape[-1]), 0.0),
                bias=unbiased_future,
            )
        )
    return out + [
        Mutation(
            "mask_after_softmax",
            _W,
            "weights set to -inf above the diagonal after the softmax",
            mask=lambda s: s,
            after_softmax=lambda w: w.masked_fill(causal_hide(w.shape[-1]), -torch.inf),
        ),
    ]
