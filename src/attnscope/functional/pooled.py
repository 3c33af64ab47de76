"""A picture-sized view of a large attention matrix, computed block by block.

A ``(T, S)`` matrix of 10,000 tokens has 10^8 cells: no screen shows them, and holding them
takes 400 MB per head. :func:`pooled_matrix` cuts the matrix into ``pool x pool`` tiles of
(query, key) pairs and keeps one number per tile, the largest or the mean of the pairs a
query may see, computing the matrix a block of queries and keys at a time (and the softmax's
normaliser in a first pass, for the weights). Memory: the pooled matrix plus one block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import AttnScopeError, describe
from ..stages import Stage
from .blocked import (
    _BLOCK_ENTRIES,
    _bias_block,
    _check,
    _hidden,
    _hides_some,
    _Layout,
    _positive_int,
)

__all__ = ["PooledMatrix", "pooled_matrix", "pooled_matrices", "pool_matrix", "REDUCTIONS"]

#: the stages a pooled matrix can show, in pipeline order
POOLABLE = (
    Stage.SCORES,
    Stage.SCALED_SCORES,
    Stage.BIASED_SCORES,
    Stage.MASKED_SCORES,
    Stage.WEIGHTS,
)
REDUCTIONS = ("max", "mean")
#: the matrix stages in the order a block of scores passes through them
_PIPELINE = POOLABLE


@dataclass
class PooledMatrix:
    """One number per ``pool x pool`` tile of (query, key) pairs.

    Attributes:
        values: ``(..., R, C)``, ``R = ceil(T / pool)`` tiles of queries by ``C = ceil(S /
            pool)`` of keys; the reduction over the pairs of a tile that a query may see.
        hidden: ``(R, C)`` bool: tiles where no query may see any key (the causal mask or a
            window hides all of them); their value is ``-inf`` (max) or NaN (mean).
        pool: tokens per tile side (the last tile of a side may hold fewer).
        reduce: ``"max"`` or ``"mean"``.
        stage: the stage pooled.
        tokens, keys: ``T`` and ``S``.
    """

    values: torch.Tensor
    hidden: torch.Tensor
    pool: int
    reduce: str
    stage: str
    tokens: int
    keys: int

    def describe(self) -> str:
        """``"max over 40 x 40 tiles of (query, key)"``, for titles."""
        if self.pool == 1:
            return "every (query, key) pair"
        return f"{self.reduce} over {self.pool} x {self.pool} tiles of (query, key)"


def _check_pool(stage: str | Stage, reduce: str, pool: object) -> Stage:
    names = ", ".join(s.value for s in POOLABLE)
    try:
        st = Stage(stage)
    except ValueError:
        raise AttnScopeError(f"stage: expected one of {names}, got {stage!r}") from None
    if st not in POOLABLE:
        raise AttnScopeError(f"stage: expected one of {names}, got {st.value!r}")
    if reduce not in REDUCTIONS:
        raise AttnScopeError(f"reduce: expected 'max' or 'mean', got {describe(reduce)}")
    _positive_int("pool", pool)
    return st


def _tiles(
    values: torch.Tensor,
    visible: torch.Tensor | None,
    pool: int,
    reduce: str,
    neutral: bool = False,
):
    """Reduce ``(..., r, c)`` over ``pool x pool`` tiles of the visible pairs (``visible``
    ``(r, c)`` bool, None: all of them); ``r`` and ``c`` are padded up to whole tiles with
    invisible pairs. ``neutral``: the hidden pairs already hold what cannot change the
    reduction (``-inf`` under a max, ``0`` under a sum), so they are not filled again.
    Returns ``(values, count)``, the sums (mean) or maxima and the number of visible pairs
    per tile."""
    r, c = values.shape[-2:]
    pr, pc = -r % pool, -c % pool
    fill = -torch.inf if reduce == "max" else 0.0
    if pr or pc:
        if visible is None:
            visible = torch.ones(r, c, dtype=torch.bool, device=values.device)
        values = torch.nn.functional.pad(values, (0, pc, 0, pr), value=fill)
        visible = torch.nn.functional.pad(visible, (0, pc, 0, pr), value=False)
    R, C = values.shape[-2] // pool, values.shape[-1] // pool
    lead = values.shape[:-2]
    tiles = values.reshape(*lead, R, pool, C, pool)
    if visible is None:  # every pair counts: no masking pass
        count = torch.full((R, C), pool * pool, dtype=torch.long, device=values.device)
        out = tiles.amax((-3, -1)) if reduce == "max" else tiles.sum((-3, -1))
        return out, count
    seen = visible.reshape(R, pool, C, pool)
    count = seen.sum((1, 3))  # (R, C)
    if not neutral:
        tiles = tiles.masked_fill(~seen, fill)
    out = tiles.amax((-3, -1)) if reduce == "max" else tiles.sum((-3, -1))
    if neutral:  # a tile no query may see: what a filled one reduces to
        out = out.masked_fill_(count == 0, fill)
    return out, count


def pooled_matrix(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    stage: str | Stage = "weights",
    reduce: str = "max",
    pool: int,
    causal: bool = False,
    window: int | None = None,
    bias_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    logsumexp: torch.Tensor | None = None,
) -> PooledMatrix:
    """A matrix stage of attention pooled over tiles, never holding the ``(T, S)`` matrix.

    Args:
        queries: ``(..., T, D)`` (after any norm and rotation: what the scores are made of);
            ``...`` is ``()``, ``(B,)`` or ``(B, H)``.
        keys: ``(..., S, D)``; ``(B, K, S, D)`` with ``K`` dividing ``H`` are grouped heads.
        stage: ``scores``, ``scaled_scores``, ``biased_scores``, ``masked_scores`` or
            ``weights``, as :func:`~attnscope.functional.attend` makes them.
        reduce: ``"max"`` or ``"mean"`` over the pairs of a tile (for ``masked_scores`` and
            ``weights`` of a causal layer, the pairs a query may see).
        pool: tokens per tile side.
        causal, window, bias_slopes, scale: as :func:`blocked_attention`.
        logsumexp: ``(..., T)`` each query's ``log sum_j exp(logit_j)`` when already known
            (:attr:`AttentionSummary.logsumexp`); otherwise the weights cost one more pass.

    Returns:
        a :class:`PooledMatrix` with values ``(..., ceil(T / pool), ceil(S / pool))``.
    """
    name = _check_pool(stage, reduce, pool).value
    return pooled_matrices(
        queries,
        keys,
        stages=(name,),
        reduce=reduce,
        pool=pool,
        causal=causal,
        window=window,
        bias_slopes=bias_slopes,
        scale=scale,
        logsumexp=logsumexp,
    )[name]


def pooled_matrices(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    stages: Sequence[str | Stage],
    reduce: str = "max",
    pool: int,
    causal: bool = False,
    window: int | None = None,
    bias_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    logsumexp: torch.Tensor | None = None,
) -> dict[str, PooledMatrix]:
    """:func:`pooled_matrix` of several stages in one pass over the matrix: each block of
    scores is made once and carried through the pipeline in place (scaled, biased, masked,
    normalised), pooled at every stage asked for. Returns ``{stage name: PooledMatrix}``."""
    want = sorted({_check_pool(st, reduce, pool) for st in stages}, key=lambda st: st.order)
    if not want:
        raise AttnScopeError("stages: expected at least one stage to pool, got none")
    _check(queries, keys, keys, causal, window, bias_slopes, scale, 1)  # grad refused too
    t_q, t_k = queries.shape[-2], keys.shape[-2]
    offset = t_k - t_q
    biased = want[-1].order >= Stage.BIASED_SCORES.order
    lay = _Layout(queries, keys, keys, bias_slopes if biased else None)
    factor = keys.shape[-1] ** -0.5 if scale is None else float(scale)
    masks = causal and want[-1].order >= Stage.MASKED_SCORES.order
    b, kv, g, n, d = lay.q.shape
    k_all = lay.k.squeeze(2)
    # the scale folded into the queries once, unless the raw scores are pooled too
    first = Stage.SCORES if want[0] is Stage.SCORES else Stage.SCALED_SCORES
    q_all = lay.q if first is Stage.SCORES else lay.q * factor
    # blocks are whole tiles: about as many entries as the blocked core's
    side = max(1, math.isqrt(_BLOCK_ENTRIES // max(1, b * kv * g)))
    blk = pool * max(1, side // pool)
    kpos_all = torch.arange(t_k, device=queries.device)

    def unseen(q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether no query of q0..q1 may see any key of k0..k1 (nothing to compute)."""
        if not causal:
            return False
        lo, hi = q0 + offset, q1 - 1 + offset
        return k0 > hi or (window is not None and k1 - 1 <= lo - window)

    def block(q0: int, q1: int, k0: int, k1: int):
        """The scores (raw or scaled, ``first``) of queries q0..q1 and keys k0..k1."""
        q = q_all[:, :, :, q0:q1, :].reshape(b, kv, g * (q1 - q0), d)
        return (q @ k_all[:, :, k0:k1, :].transpose(-2, -1)).view(b, kv, g, q1 - q0, k1 - k0)

    def advance(s, at: Stage, to: Stage, q0, q1, k0, k1, lse):
        """``s`` carried in place from stage ``at`` to stage ``to``; with which pairs a
        query may see once masked (None: all)."""
        visible = None
        qpos = torch.arange(q0, q1, device=queries.device) + offset
        for step in _PIPELINE[_PIPELINE.index(at) + 1 : _PIPELINE.index(to) + 1]:
            if step is Stage.SCALED_SCORES:
                s.mul_(factor)
            elif step is Stage.BIASED_SCORES and lay.slopes is not None:
                s += _bias_block(lay.slopes, qpos, kpos_all[k0:k1], s.dtype)
            elif step is Stage.MASKED_SCORES and _hides_some(
                q0 + offset, q1 - 1 + offset, k0, k1, masks, window
            ):
                hide = _hidden(qpos, kpos_all[k0:k1], masks, window)
                s.masked_fill_(hide, -torch.inf)
                visible = ~hide
            elif step is Stage.WEIGHTS:
                s.sub_(lse[..., q0:q1, :]).exp_()
        return s, visible

    lse = None
    if Stage.WEIGHTS in want and logsumexp is not None:
        lse = logsumexp.reshape(b, kv, g, n, 1)
    elif Stage.WEIGHTS in want:  # the softmax's normaliser, one pass: log sum_j exp(s_ij)
        lse = queries.new_full((b, kv, g, n, 1), -torch.inf)
        for q0 in range(0, n, blk):
            q1 = min(q0 + blk, n)
            for k0 in range(0, t_k, blk):
                k1 = min(k0 + blk, t_k)
                if unseen(q0, q1, k0, k1):
                    continue
                s = block(q0, q1, k0, k1)
                s, _ = advance(s, first, Stage.MASKED_SCORES, q0, q1, k0, k1, None)
                lse[..., q0:q1, :] = torch.logaddexp(
                    lse[..., q0:q1, :], torch.logsumexp(s, -1, keepdim=True)
                )
    R, C = -(-n // pool), -(-t_k // pool)
    # tiles never written (hidden from every query) keep -inf and a count of 0
    outs = {st: queries.new_full((b, kv, g, R, C), -torch.inf) for st in want}
    counts = {st: torch.zeros(R, C, dtype=torch.long, device=queries.device) for st in want}
    # only the masked stages may skip a block no query sees: the others show every pair
    skip = masks and want[0].order >= Stage.MASKED_SCORES.order
    for q0 in range(0, n, blk):
        q1 = min(q0 + blk, n)
        for k0 in range(0, t_k, blk):
            k1 = min(k0 + blk, t_k)
            if skip and unseen(q0, q1, k0, k1):
                continue
            s, at, visible = block(q0, q1, k0, k1), first, None
            for st in want:  # in pipeline order, each made in place from the one before
                s, seen_now = advance(s, at, st, q0, q1, k0, k1, lse)
                visible = seen_now if seen_now is not None else visible
                at = st
                masked = st.order >= Stage.MASKED_SCORES.order
                # hidden pairs hold -inf (masked scores) or 0 (weights): neutral to a max,
                # and a weight of 0 to a sum
                neutral = st is Stage.WEIGHTS or (st is Stage.MASKED_SCORES and reduce == "max")
                tiles, count = _tiles(s, visible if masked else None, pool, reduce, neutral)
                r0, c0 = q0 // pool, k0 // pool
                outs[st][..., r0 : r0 + tiles.shape[-2], c0 : c0 + tiles.shape[-1]] = tiles
                counts[st][r0 : r0 + count.shape[0], c0 : c0 + count.shape[1]] = count
    found = {}
    for st in want:
        out, count = outs[st], counts[st]
        hidden = count == 0
        if reduce == "mean":
            out = (out / count.clamp(min=1)).masked_fill(hidden, torch.nan)
        values = out.reshape(*lay.shape, R, C)
        found[st.value] = PooledMatrix(values, hidden, pool, reduce, st.value, n, t_k)
    return found


def pool_matrix(
    matrix: torch.Tensor,
    *,
    pool: int,
    reduce: str = "max",
    stage: str | Stage = "weights",
    hidden: torch.Tensor | None = None,
) -> PooledMatrix:
    """:class:`PooledMatrix` of a matrix already held, ``(..., T, S)`` (a full trace's).

    ``hidden``: ``(T, S)`` bool, the pairs no query may see (default: none).
    """
    st = _check_pool(stage, reduce, pool)
    t, s = matrix.shape[-2:]
    visible = (
        torch.ones(t, s, dtype=torch.bool, device=matrix.device) if hidden is None else ~hidden
    )
    out, count = _tiles(matrix, visible, pool, reduce)
    empty = count == 0
    if reduce == "mean":
        out = (out / count.clamp(min=1)).masked_fill(empty, torch.nan)
    return PooledMatrix(out, empty, pool, reduce, st.value, t, s)
