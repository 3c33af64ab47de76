"""Mistakes in the causal mask: none, the wrong cells, a fill that still gets weight."""

from __future__ import annotations

import torch

from ...stages import Stage
from ..compare import close
from ..reference import Mutation, band_hide, causal_hide, window_hide
from .base import Context, Evidence, define

T = torch.Tensor
_M = Stage.MASKED_SCORES


def _hidden(c: Context, n: int, diagonal: int = 1) -> T:
    """What the layer's mask hides, with the causal diagonal at ``diagonal``: the future,
    and what a declared sliding window hides as well (the window is judged on its own)."""
    hide = causal_hide(n, diagonal)
    return hide if c.spec.window is None else hide | window_hide(n, c.spec.window)


def _masked(ev: Evidence) -> tuple[T, T, T] | None:
    """(user, reference masked scores, reference scaled scores), shapes agreeing."""
    masked = ev.ref.get("masked_scores")
    if masked is None or ev.user is None or ev.user.shape != masked.shape:
        return None
    return ev.user, masked, ev.ref["scaled_scores"]


def _unmasked(ev: Evidence) -> bool:
    """No mask at all, or none on the future: every key after its query seen (a sliding
    window's band cut on the far past alone, Samba's ``triu`` without its ``tril``)."""
    got = _masked(ev)
    if got is None:
        return False
    u, masked, scaled = got
    if close(u, scaled):
        return True
    n = u.shape[-1]
    if u.shape[-2] != n or n < 2:
        return False
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    hid = bool((~torch.isfinite(masked))[..., future].all())
    # the future carries its scores (not a fill that leaves it seen: that is the fill value)
    before = ev.ref.get("biased_scores", scaled)
    return hid and close(u[..., future], before[..., future])


@define(
    "missing_mask",
    expected="expected scores of keys after the query (j > i) set to -inf",
    recognise=_unmasked,
)
def _missing_mask(c: Context) -> list[Mutation]:
    if not c.spec.causal:
        return []
    return [Mutation("missing_mask", _M, "no mask", mask=lambda s: s)]


def _wrong_cells(ev: Evidence) -> bool:
    got = _masked(ev)
    if got is None:
        return False
    u, masked, _ = got
    hidden = ~torch.isfinite(masked)
    very_negative = ~torch.isfinite(u) | (u < -1e4)
    return bool(very_negative.any()) and not torch.equal(very_negative, hidden)


@define(
    "mask_diagonal",
    expected="expected torch.triu(ones, diagonal=1): each token sees itself and the tokens "
    "before it, none after",
    recognise=_wrong_cells,
)
def _mask_diagonal(c: Context) -> list[Mutation]:
    if not c.spec.causal:
        return []
    out = []
    for d, label in (
        (0, "the mask also hides each token itself (triu diagonal=0)"),
        (2, "the mask shows the next token (triu diagonal=2)"),
        (3, "the mask shows the next two tokens (triu diagonal=3)"),
    ):
        for fill in (-torch.inf, -1e9):
            out.append(
                Mutation(
                    "mask_diagonal",
                    _M,
                    label,
                    mask=lambda s, d=d, f=fill: s.masked_fill(_hidden(c, s.shape[-1], d), f),
                )
            )
    for d, label in ((0, "the mask hides the past (tril)"), (-1, "the mask hides the past")):
        out.append(
            Mutation(
                "mask_diagonal",
                _M,
                label + " and shows the future",
                mask=lambda s, d=d: s.masked_fill(
                    torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).tril(d), -torch.inf
                ),
            )
        )
    return out


def _finite_fill(ev: Evidence) -> bool:
    got = _masked(ev)
    if got is None:
        return False
    u, masked, scaled = got
    hidden = ~torch.isfinite(masked)
    fills = u[hidden]
    if not (fills.numel() and torch.isfinite(fills).all()):
        return False
    if close(u[~hidden], scaled[~hidden]):
        return True
    if "biased_scores" not in ev.ref:
        return False
    # beside a position bias, the seen scores may differ from the reference's by a constant
    # per query row (ALiBi written slope * (j - n + 1): the same bias, as a softmax reads it)
    gap = (u - masked).masked_fill(hidden, float("nan"))
    lo = gap.nan_to_num(float("inf")).amin(-1, keepdim=True)
    hi = gap.nan_to_num(float("-inf")).amax(-1, keepdim=True)
    rows = torch.isfinite(lo)
    return bool(rows.any() and ((hi - lo)[rows] < 1e-6 * (1 + masked[~hidden].abs().max())).all())


def _band_fill_value(c: Context) -> list[Mutation]:
    """A bidirectional local window's mask filled with a finite value, or cast to 0/1 and
    added (SNAC's boolean band handed to SDPA as floats)."""
    if c.spec.window is None:
        return []

    def hide(n: int) -> T:
        return band_hide(n, c.spec.window)

    out = [
        Mutation(
            "mask_fill_value",
            _M,
            f"the local window's hidden scores filled with {value:g}",
            mask=lambda s, v=value: s.masked_fill(hide(s.shape[-1]), v),
            facts={"fill": value, "name": f"{value:g}"},
        )
        for value in (0.0, -1.0, 1.0)
    ]
    out.append(
        Mutation(
            "mask_fill_value",
            _M,
            "the local window as a 0/1 mask added to the scores (1 where a key is seen, 0 "
            "where hidden)",
            mask=lambda s: s + (~hide(s.shape[-1])).to(s.dtype),
            facts={"fill": "0/1 added", "name": "1 where a key is seen, 0 where hidden"},
        )
    )
    return out


@define(
    "mask_fill_value",
    expected="expected -inf (or a very negative number) so masked keys get weight 0",
    recognise=_finite_fill,
)
def _mask_fill_value(c: Context) -> list[Mutation]:
    if not c.spec.causal:
        return _band_fill_value(c)
    fills = [(0.0, "0"), (-1.0, "-1"), (1.0, "1"), (-10.0, "-10"), (-100.0, "-100")]
    # the minus sign dropped from a large fill (SASRec's ``-2 ** 32 + 1`` written
    # ``2 ** 32 + 1``): the hidden keys take every weight, alike; any such value does
    fills += [(1e9, "a large positive value (the minus sign dropped?)")]
    fills += [(-v * c.spec.scale, f"{-v:g} before scaling") for v in (1.0, 10.0, 100.0)]
    out = [
        Mutation(
            "mask_fill_value",
            _M,
            f"masked scores filled with {text}",
            mask=lambda s, v=value: s.masked_fill(_hidden(c, s.shape[-1]), v),
            facts={"fill": value, "name": text},
        )
        for value, text in fills
    ]
    # a boolean mask cast to 0/1 and added, as if it were an additive one: the hidden keys
    # are a unit of score apart from the seen ones, not hidden
    for added, text in (
        (lambda hide: ~hide, "1 where a key is seen, 0 where hidden"),
        (lambda hide: hide, "1 where a key is hidden"),
    ):
        out.append(
            Mutation(
                "mask_fill_value",
                _M,
                f"a 0/1 mask added to the scores ({text})",
                mask=lambda s, a=added: s + a(_hidden(c, s.shape[-1])).to(s.dtype),
                facts={"fill": "0/1 added", "name": text},
            )
        )
    alibi = c.spec.position_bias
    if alibi is not None:
        # one additive mask of ALiBi and the future, its future entries 0 instead of -inf
        # (Step-Audio's ``bias.masked_fill(tril == 0, 0.0)``): the later keys are seen, with
        # no position bias
        def unmasked_future(h, n):
            b = alibi.bias(h, n)
            return None if b is None else b.masked_fill(_hidden(c, n), 0.0)

        out.append(
            Mutation(
                "mask_fill_value",
                _M,
                "an additive mask of position biases whose hidden entries are 0, not -inf "
                "(the later keys seen, with no bias)",
                mask=lambda s: s,
                bias=unmasked_future,
                facts={"fill": 0.0, "name": "0 in the additive mask"},
            )
        )
    return out
