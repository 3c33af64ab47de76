"""ALiBi, read back from the bias a layer adds to its scores.

The reference adds the standard bias, ``slope_h * (j - i)`` with the geometric slopes for
the layer's head count (:func:`attnscope.functional.alibi_slopes`); a layer that adds its
bias before the scale (Falcon) is held to the same slopes added there. What the layer
added is kept as seen: its slopes, read per head as the step from one key to the next, name
the mistake when they are not the standard ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..functional import alibi_slopes

__all__ = ["Alibi", "read_slopes", "alibi_bias", "is_symmetric", "is_by_key", "per_head_views"]

T = torch.Tensor


def alibi_bias(slopes: T, n: int, symmetric: bool = False, by_key: bool = False) -> T:
    """``(H, n, n)``: ``slope_h * (j - i)``, 0 on the diagonal, more negative further back
    (equal, per query row, to BLOOM's ``slope_h * j``: a constant a softmax ignores), or
    with ``symmetric`` ``-slope_h * |i - j|`` (both the same where a causal mask hides
    ``j > i``; bidirectional layers use either), or with ``by_key`` ``slope_h * j`` itself
    (the same for every query: a softmax over the keys cannot tell it from the distance
    form; one over the queries, a mistake, can)."""
    pos = torch.arange(n, dtype=torch.float64)
    d = pos[None, None, :] - pos[None, :, None]
    if by_key:
        d = pos[None, None, :].expand(1, n, n)
    return slopes.to(torch.float64)[:, None, None] * (-d.abs() if symmetric else d)


@dataclass(eq=False)
class Alibi:
    """The reference's position bias: the standard slopes for ``heads``; ``before_scale``
    when the layer adds it before scaling the scores; ``seen``: the slopes the layer used."""

    heads: int
    before_scale: bool = False
    seen: T | None = None
    symmetric: bool = False  # -slope * |i - j| (a bidirectional layer's choice)
    by_key: bool = False  # slope * j, the same for every query (BLOOM's, labml's (j + 1))

    @property
    def slopes(self) -> T:
        return alibi_slopes(self.heads)

    def bias(self, heads: int, n: int) -> T:
        return alibi_bias(self.slopes, n, self.symmetric, self.by_key)


def _steps(e: T, heads: int) -> T | None:
    """Per head, the median step from key ``j`` to ``j + 1`` before the query, for a bias
    laid out ``(B, H, T_q, T_k)``; None where a head has no such step."""
    d = e[..., 1:] - e[..., :-1]  # step from key j to j + 1
    n_q, n_k = e.shape[-2], e.shape[-1]
    before = torch.ones(n_q, n_k - 1, dtype=torch.bool).tril(n_k - n_q - 1)  # j + 1 <= i
    ok = torch.isfinite(d) & (e[..., 1:] > -1e4) & (e[..., :-1] > -1e4) & before
    slopes = []
    for h in range(heads):
        steps = d[:, h][ok[:, h]]
        if steps.numel() == 0:
            return None
        slopes.append(steps.median())
    return torch.stack(slopes)


def _fits(e: T, slopes: T) -> bool:
    """Whether ``e`` ``(B, H, T_q, T_k)`` is ``slope_h * j`` plus a constant per query row
    on the keys up to the query (where the causal part of a bias lies), where finite."""
    n_q, n_k = e.shape[-2], e.shape[-1]
    j = torch.arange(n_k, dtype=torch.float64)
    rest = e - slopes[None, :, None, None] * j
    up_to = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    finite = torch.isfinite(e) & (e > -1e4) & up_to
    rows = rest.masked_fill(~finite, float("nan"))
    spread = (rows - rows.nanmean(-1, keepdim=True)).nan_to_num(0).abs()
    return bool((spread < 1e-6 * (1 + e[finite].abs().amax())).all()) if finite.any() else False


def per_head_views(tensor: T, scores_shape: tuple[int, ...], heads: int) -> list[T]:
    """The bias as ``(B, H, T_q, T_k)``: read as laid out ``(..., H, T_q, T_k)`` first,
    then, for scores in another layout (sequence-first ``[T_q, T_k, B, H]``), each order of
    its axes that puts a head-sized axis and two token axes last."""
    try:
        e = tensor.detach().to(torch.float64).expand(scores_shape)
    except RuntimeError:
        return []
    out = []
    n_q, n_k = e.shape[-2], e.shape[-1]
    if e.numel() % (heads * n_k * n_q) == 0:
        out.append(e.reshape(-1, heads, n_q, n_k))
        if e.dim() == 3 and e.shape[0] > heads:
            # heads stacked on the batch axis head-major (SASRec's ``cat(chunk(Q, H), 0)``:
            # row h * B + b), not batch-major
            out.append(e.reshape(heads, -1, n_q, n_k).transpose(0, 1))
    if e.dim() > 4:
        return out
    axes = range(e.dim())
    for a_h in axes:
        for a_q in axes:
            for a_k in axes:
                if len({a_h, a_q, a_k}) < 3 or (a_h, a_q, a_k) == (
                    e.dim() - 3,
                    e.dim() - 2,
                    e.dim() - 1,
                ):
                    continue
                if e.shape[a_h] != heads or e.shape[a_q] < 2 or e.shape[a_k] < 2:
                    continue
                rest = [a for a in axes if a not in (a_h, a_q, a_k)]
                p = e.permute(*rest, a_h, a_q, a_k)
                out.append(p.reshape(-1, heads, e.shape[a_q], e.shape[a_k]))
    return out


def read_slopes(tensor: T, scores_shape: tuple[int, ...], heads: int) -> T | None:
    """Per head, the step the bias takes from one key to the next before the query,
    ``(H,)``; None when the tensor cannot be read per head. Scores laid out otherwise than
    ``(..., H, T_q, T_k)`` are read in the order of axes in which the bias is ``slope_h *
    j`` plus a constant per query row."""
    views = per_head_views(tensor, scores_shape, heads)
    first = None
    for i, e in enumerate(views):
        slopes = _steps(e, heads)
        if slopes is None:
            continue
        if i == 0:
            first = slopes
        if _fits(e, slopes):
            return slopes
    return first


def is_alibi(tensor: T, scores_shape: tuple[int, ...], heads: int) -> bool:
    """Whether the bias is, per head, ``slope_h * j`` plus a constant per query row on the
    keys up to each query (ALiBi, whatever its slopes or sign): not a relative position
    bias of buckets or learned values (T5's, MPNet's)."""
    for e in per_head_views(tensor, scores_shape, heads):
        if e.shape[-1] != e.shape[-2] or e.shape[-1] < 3:
            continue  # a view whose "keys" are the batch or heads: any two points fit a line
        slopes = _steps(e, heads)
        if slopes is not None and _fits(e, slopes):
            return True
    return False


def is_by_key(tensor: T, scores_shape: tuple[int, ...]) -> bool:
    """Whether the bias is a function of the key alone on the keys up to each query (BLOOM's
    ``slope * j``, labml's ``slope * (j + 1)``): every query sees the same value for a key."""
    try:
        e = tensor.detach().to(torch.float64).expand(scores_shape)
    except RuntimeError:
        return False
    if e.dim() >= 3 and e.shape[-1] != e.shape[-2] and e.shape[0] == e.shape[1]:
        e = e.movedim((0, 1), (-2, -1))  # scores laid out sequence-first, [i, j, ...]
    n_q, n_k = e.shape[-2], e.shape[-1]
    if n_q != n_k or n_q < 3:
        return False
    e = e.reshape(-1, n_q, n_k)
    finite = torch.isfinite(e) & (e > -1e4)
    up_to = torch.ones(n_q, n_k, dtype=torch.bool).tril() & finite
    rest = e - e.diagonal(dim1=-2, dim2=-1)[:, None, :]  # each key's value at its own query
    return bool(up_to.tril(-1).any()) and bool(
        (rest[up_to].abs() < 1e-5 * (1 + e[up_to].abs().max())).all()
    )


def is_symmetric(tensor: T, scores_shape: tuple[int, ...]) -> bool:
    """Whether the bias falls off after the query as it does before it (``-|i - j|``)."""
    try:
        e = tensor.detach().to(torch.float64).expand(scores_shape)
    except RuntimeError:
        return False
    if e.dim() >= 3 and e.shape[-1] != e.shape[-2] and e.shape[0] == e.shape[1]:
        e = e.movedim((0, 1), (-2, -1))  # scores laid out sequence-first, [i, j, b, h]
    n_q, n_k = e.shape[-2], e.shape[-1]
    if n_q != n_k or n_q < 3:
        return False
    e = e.reshape(-1, n_q, n_k)[0]
    finite = torch.isfinite(e) & (e > -1e4)
    if not bool(finite.triu(1).any()):
        return False  # the future is masked away: either form
    centred = e - e.diagonal()[:, None]
    both = finite & finite.T
    return bool(torch.allclose(centred[both], centred.T[both], atol=1e-5))
