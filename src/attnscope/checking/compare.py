"""Compare tensors with tolerances that fit float32, and find a stage among recorded tensors.

Correct code comes in many shapes, so a stage is "found" when some recorded tensor equals
the reference in any equivalent form: another layout (heads first or tokens first, merged
or per head, batch second), a positive factor where the scale may be folded in (queries,
keys, scores), and any fill that a softmax turns into weight 0 where the causal mask hides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..stages import Stage
from .record import Op

__all__ = ["close", "Found", "find_stage", "RTOL"]

T = torch.Tensor

#: Tolerance relative to the largest reference magnitude: float32 code against float64.
RTOL = 2e-4

_FOLDABLE = {Stage.QUERIES, Stage.KEYS, Stage.SCORES, Stage.QUERY}
_SCORE_LIKE = {Stage.SCORES, Stage.SCALED_SCORES, Stage.MASKED_SCORES}


def close(a: T, b: T, rtol: float = RTOL) -> bool:
    """``a`` equals ``b`` (float64 reference) up to float32 error; NaN where ``b`` is NaN."""
    if a.shape != b.shape:
        return False
    a, b = a.to(torch.float64), b.to(torch.float64)
    if b.numel() == 0:
        return True
    diff = (a - b).abs()
    bmax = b.abs().amax()
    if bool(torch.isfinite(diff).all()) and bool(torch.isfinite(bmax)):  # the common case
        return diff.amax().item() <= rtol * max(bmax.item(), 1e-12) + 1e-7
    fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fin_a, fin_b):
        return False
    odd = ~fin_b
    oa, ob = a[odd], b[odd]
    if not torch.equal(torch.isnan(oa), torch.isnan(ob)):
        return False
    inf = ~torch.isnan(ob)
    if not torch.equal(oa[inf], ob[inf]):
        return False
    fa, fb = a[fin_b], b[fin_b]
    if fb.numel() == 0:
        return True
    scale = max(fb.abs().max().item(), 1e-12)
    return (fa - fb).abs().max().item() <= rtol * scale + 1e-7


def _quick_reject(r: T, form: T, foldable: bool) -> bool:
    """A cheap look at a few entries: most recorded tensors are plainly something else.

    Score-like tensors are sampled on their last row, which a causal mask never hides.
    """
    if r.dim() >= 2 and form.shape[-1] == form.shape[-2]:
        r, form = r[..., -1, :], form[..., -1, :]
    a = r.reshape(-1)[:32].to(torch.float64)
    b = form.reshape(-1)[:32]
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not fin.any():
        return False
    a, b = a[fin], b[fin]
    if foldable:
        denom = (b * b).sum()
        if denom == 0:
            return False
        a = a / ((a * b).sum() / denom) if (a * b).sum() != 0 else a
    return (a - b).abs().max().item() > 1e-2 * max(b.abs().max().item(), 1e-6) + 1e-5


@dataclass
class Found:
    """Where a stage was seen: the op, its location, the layout and any folded factor."""

    op: Op
    layout: str
    factor: float = 1.0
    tensor: T | None = None  # the user's tensor in the reference layout

    @property
    def location(self) -> str | None:
        return self.op.location


def _forms(ref: T, stage: Stage, batched: bool) -> list[tuple[str, T]]:
    """The reference stage in every layout correct code stores it in."""
    out: list[tuple[str, T]] = [("", ref)]
    if ref.dim() == 4:  # (B, H, T, X)
        b, h, n, x = ref.shape
        out += [
            ("tokens before heads", ref.transpose(1, 2)),
            ("heads merged", ref.transpose(1, 2).reshape(b, n, h * x)),
            ("batch and heads merged", ref.reshape(b * h, n, x)),
            ("tokens first", ref.permute(2, 0, 1, 3)),
            ("tokens first, heads merged", ref.permute(2, 0, 1, 3).reshape(n, b, h * x)),
            # an engine's flattened batch: every sequence's tokens in one run of rows
            ("batch and tokens merged", ref.transpose(1, 2).reshape(b * n, h, x)),
            ("batch and tokens merged, heads merged", ref.transpose(1, 2).reshape(b * n, h * x)),
        ]
        if stage in _SCORE_LIKE or stage in (Stage.BIASED_SCORES, Stage.WEIGHTS):
            # sequence-first einsum code ("ibhd,jbhd->ijbh"): (T_q, T_k, B, H)
            out.append(("queries and keys first", ref.permute(2, 3, 0, 1)))
    elif ref.dim() == 3:  # (B, T, X)
        out.append(("tokens first", ref.transpose(0, 1)))
    if stage is Stage.KEYS:
        out += [(f"{name} transposed".strip(), t.transpose(-2, -1)) for name, t in list(out)]
    if not batched:
        out += [(name, t.squeeze(0)) for name, t in list(out) if t.shape[0] == 1]
        out += [(name, t.squeeze(1)) for name, t in list(out) if t.dim() > 2 and t.shape[1] == 1]
    return out


def _visible(ref: T) -> T:
    """Entries a correct implementation must reproduce: finite reference entries."""
    return torch.isfinite(ref)


def _hidden_ok(r: T, ref: T, visible: T, factor: float) -> bool:
    """Masked entries: any fill the softmax turns into weight 0 (-inf, -1e9, dtype min)."""
    hidden = ~visible
    if not hidden.any():
        return True
    vals = r[hidden]
    if torch.isnan(vals).any():
        return False
    top = (ref[visible].abs().max().item() if visible.any() else 0.0) * max(factor, 1.0)
    return bool((vals < -(top + 80.0)).all())


def _match(r: T, ref: T, stage: Stage, spec_scale: float, causal: bool) -> float | None:
    """The factor by which ``r`` equals ``ref`` in this stage's sense, or ``None``."""
    if r.shape != ref.shape:
        return None
    r64 = r.to(torch.float64)
    visible = _visible(ref)
    if causal and stage in _SCORE_LIKE and ref.shape[-1] == ref.shape[-2]:
        # the mask may come before or after any score stage: judge the cells it never hides
        n = ref.shape[-1]
        visible = visible & torch.ones(n, n, dtype=torch.bool).tril()
    if stage in _SCORE_LIKE:
        # the mask may come before or after this stage: compare where the reference is finite
        rv, fv = r64[visible], ref[visible]
        if rv.numel() == 0 or not torch.isfinite(rv).all():
            return None
        denom = (fv * fv).sum().item()
        if denom == 0:
            return None
        c = (rv * fv).sum().item() / denom
        if c <= 0:
            return None
        if stage is Stage.SCALED_SCORES and abs(c - 1) > 1e-3:
            return None
        if stage is Stage.MASKED_SCORES and not (
            abs(c - 1) < 1e-3 or abs(c * spec_scale - 1) < 1e-3
        ):
            return None
        if not close(rv, c * fv):
            return None
        upper = ~visible
        if stage is Stage.MASKED_SCORES:
            return c if upper.any() and _hidden_ok(r64, ref, visible, c) else None
        if upper.any() and not (
            _hidden_ok(r64, ref, visible, c) or close(r64[upper], c * ref[upper])
        ):
            return None
        return c
    if stage in _FOLDABLE:
        if not torch.isfinite(r64).all():
            return None
        denom = (ref * ref).sum().item()
        if denom == 0:
            return 1.0 if close(r64, ref) else None
        c = (r64 * ref).sum().item() / denom
        return c if c > 0 and close(r64, c * ref) else None
    return 1.0 if close(r64, ref) else None


def find_stage(
    ops: list[Op],
    stage: Stage,
    ref: T,
    *,
    batched: bool,
    spec_scale: float = 1.0,
    causal: bool = False,
) -> Found | None:
    """The first recorded tensor that equals ``ref`` in some equivalent form."""
    forms = _forms(ref, stage, batched)
    shapes = {tuple(f.shape) for _, f in forms}
    for op in ops:
        if tuple(op.output.shape) not in shapes or op.stale or not op.comparable:
            continue
        for layout, form in forms:
            if tuple(form.shape) != tuple(op.output.shape):
                continue
            if _quick_reject(op.output, form, stage in _FOLDABLE or stage in _SCORE_LIKE):
                continue
            factor = _match(op.output, form, stage, spec_scale, causal)
            if factor is not None:
                return Found(op, layout, factor)
    return None
