"""A learned relative position bias (T5's buckets, Tortoise's, MPNet's), taken as the layer
computes it.

A learned bias has no standard values to hold it to, as ALiBi has its slopes: the reference
adds what the layer adds, read back at each length from a run of the layer, and judges the
rest of the layer around it. It is modelled only where it is what the contract's ``learned``
bias means: made from the layer's trainable parameters alone (the same for every sequence
and every input), and, per head, a function of the key's offset from its query (a relative
bias: a Toeplitz matrix per head). A learned table of absolute positions, or of
two-dimensional offsets read in one-dimensional token order (Swin's, BEiT's), is none and
stays refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .alibi import per_head_views
from .features import Unsupported, hides

__all__ = ["LearnedBias", "relative_table", "same_for_every_key"]

T = torch.Tensor


def _is_relative(e: T) -> bool:
    """Whether ``e`` ``(B, H, n, n)`` is, where finite, the same for every sequence and, per
    head, constant along each diagonal (a function of ``j - i`` alone)."""
    n = e.shape[-1]
    if e.shape[-2] != n or n < 2:
        return False
    seen = ~hides(e)  # a mask folded into the bias hides cells, not values of it
    if not bool(seen.any()):
        return False
    tol = 1e-5 * (1 + e[seen].abs().max())
    first = e[:1].expand_as(e)
    both = seen & seen[:1]
    if not bool(((e - first).abs()[both] <= tol).all()):
        return False  # differs between sequences: made from the input, not a table
    for d in range(-(n - 1), n):
        diag = e[0].diagonal(d, dim1=-2, dim2=-1)  # (H, n - |d|)
        ok = seen[0].diagonal(d, dim1=-2, dim2=-1)
        for h in range(diag.shape[0]):
            vals = diag[h][ok[h]]
            if vals.numel() > 1 and bool((vals - vals[0]).abs().max() > tol):
                return False
    return True


def relative_table(tensor: T, scores_shape: tuple[int, ...], heads: int) -> T | None:
    """The bias ``(H, n, n)`` float64, masked entries 0 (the mask is read on its own), where
    it is a relative bias (see :func:`_is_relative`) in some reading of its layout per head;
    None where it is not one."""
    for e in per_head_views(tensor, scores_shape, heads):
        if _is_relative(e):
            return e[0].masked_fill(hides(e[0]), 0.0)
    return None


def same_for_every_key(table: T) -> bool:
    """Whether the bias ``(H, n, n)`` gives every key of a query the same value (no position
    bias: a softmax ignores it; made from what the probe holds the same for every token)."""
    rows = table - table[..., :1]
    return bool((rows.abs() <= 1e-6 * (1 + table.abs().max())).all())


@dataclass(eq=False)
class LearnedBias:
    """The reference's learned relative position bias: for ``heads`` heads, what the layer
    adds at ``n`` tokens (``observe(n)``, ``(H, n, n)``, or None where the layer does not
    run there), kept per length; ``before_scale`` where the layer scales the scores after
    adding it."""

    heads: int
    observe: Callable[[int], T | None] = field(repr=False)
    before_scale: bool = False
    location: str | None = None
    seen: dict[int, T] = field(default_factory=dict, repr=False)

    def bias(self, heads: int, n: int) -> T:
        """``(H, n, n)`` float64: the layer's bias at ``n`` tokens."""
        if n not in self.seen:
            table = self.observe(n)
            if table is None:
                raise Unsupported(
                    f"not supported yet: a learned relative position bias not read at {n} "
                    f"tokens (at {self.location})"
                )
            self.seen[n] = table
        return self.seen[n]
