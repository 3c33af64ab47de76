"""Attention over blocks of keys, in linear memory: the online-softmax recurrence.

:func:`blocked_attention` computes what :func:`~attnscope.functional.attend` computes without
ever holding a ``(T, T)`` matrix: queries and keys are taken ``block`` at a time, and each
query keeps a running maximum ``m``, a running sum ``l`` of ``exp(logit - m)`` and a running
weighted sum of values, rescaled by ``exp(m_old - m_new)`` whenever the maximum grows
(FlashAttention's recurrence, in plain PyTorch). Masks (causal, sliding window) and ALiBi's
bias are built per block from positions; blocks wholly hidden from a block of queries are
skipped. Memory: ``O(T * d + block * block)`` per head.

:func:`attention_summary` runs the same pass and also keeps, per query, what a reader asks of
its row of weights (entropy, the largest weight and its key, the top-k keys, the weight on the
first token, the mean distance attended), still without the matrix. :func:`summarize_weights`
computes the same summary from a full weights matrix (small inputs, and the tests).
:func:`attend_rows` computes the matrix stages of a few chosen query rows only, with the very
operations :func:`~attnscope.functional.attend` uses (a row trace).

Shapes: ``B`` batch, ``H`` query heads, ``K`` key/value heads (dividing ``H``), ``T`` query
tokens, ``S`` key tokens, ``D`` head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from ..errors import AttnScopeError, describe
from ..stages import Stage
from .core import check_qkv

__all__ = [
    "AttentionSummary",
    "blocked_attention",
    "attention_summary",
    "summarize_weights",
    "attend_rows",
    "check_rows",
]


@dataclass
class AttentionSummary:
    """What each query's row of weights looks like, one entry per ``(batch, head, query)``.

    Every field has the queries' leading shape ``(..., T)`` (``top_keys``/``top_weights``
    one more axis of ``k``).

    Attributes:
        entropy: ``-sum_j w_ij log w_ij`` in nats: 0 for one key, ``log n`` for ``n`` equal ones.
        max_weight, max_key: the largest weight and the key that holds it (the first on ties).
        top_keys, top_weights: the ``k`` heaviest keys, heaviest first, and their weights
            (fewer visible keys than ``k``: the rest are key ``-1`` with weight 0).
        sink_weight: the weight on key 0 (the "attention sink"), 0 where it is hidden.
        mean_distance: ``sum_j w_ij * (i - j)``: how far back the query looks on average
            (``i`` the query's position).
        positions: ``(T,)`` the query positions the rows belong to.
        logsumexp: ``log sum_j exp(logit_ij)``, the softmax's normaliser (weights are
            ``exp(logit_ij - logsumexp_i)``): from the blocked pass; None when the summary
            was read from weights alone (:func:`summarize_weights`).
    """

    entropy: torch.Tensor
    max_weight: torch.Tensor
    max_key: torch.Tensor
    top_keys: torch.Tensor
    top_weights: torch.Tensor
    sink_weight: torch.Tensor
    mean_distance: torch.Tensor
    positions: torch.Tensor
    logsumexp: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.top_keys.shape[-1]

    def reshaped(self, lead: Sequence[int]) -> AttentionSummary:
        """The same summary with leading shape ``lead`` (a batch of one squeezed away)."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if f.name == "positions" or t is None:
                out[f.name] = t
            elif f.name.startswith("top_"):
                out[f.name] = t.reshape(*lead, t.shape[-1])
            else:
                out[f.name] = t.reshape(*lead)
        return AttentionSummary(**out)

    def select(self, *index: int) -> AttentionSummary:
        """The summary of one leading index (a batch, then a head), e.g. ``s.select(0, 3)``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, t in out.items():
            if name != "positions" and t is not None:
                out[name] = t[index]
        return AttentionSummary(**out)

    def __repr__(self) -> str:
        return (
            f"AttentionSummary({tuple(self.entropy.shape)} queries: entropy, max_weight, "
            f"max_key, top_keys/top_weights (k={self.k}), sink_weight, mean_distance)"
        )


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AttnScopeError(f"{name}: expected a positive integer, got {describe(value)}")
    return value


def check_rows(rows: object, tokens: int, name: str = "rows") -> tuple[int, ...]:
    """``rows`` as a tuple of distinct query positions in ``0 .. tokens - 1``, or one error.

    Negative positions count from the end (``-1`` is the last token).
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        if isinstance(rows, torch.Tensor) and rows.dim() == 1 and not rows.is_floating_point():
            rows = rows.tolist()
        else:
            raise AttnScopeError(
                f"{name}: expected a list of query positions (integers), got {describe(rows)}"
            )
    if not rows:
        raise AttnScopeError(f"{name}: expected at least one query position, got none")
    out = []
    for r in rows:
        if isinstance(r, bool) or not isinstance(r, int):
            raise AttnScopeError(f"{name}: expected integer positions, got {describe(r)}")
        if not -tokens <= r < tokens:
            raise AttnScopeError(
                f"{name}: expected positions from 0 to {tokens - 1} ({tokens} tokens), got {r}"
            )
        out.append(r % tokens)
    if len(set(out)) != len(out):
        raise AttnScopeError(f"{name}: expected distinct positions, got {list(rows)}")
    return tuple(out)


def _check(queries, keys, values, causal, window, bias_slopes, scale, block):
    check_qkv(queries, keys, values)
    if window is not None:
        _positive_int("window", window)
        if not causal:
            raise AttnScopeError(
                f"window: expected causal=True with a sliding window, got {window}"
            )
    if causal and keys.shape[-2] < queries.shape[-2]:
        raise AttnScopeError(
            f"keys: expected at least as many tokens as queries {tuple(queries.shape)} for "
            f"causal attention, got {describe(keys)}"
        )
    if bias_slopes is not None:
        heads = queries.shape[1] if queries.dim() == 4 else 1
        if not isinstance(bias_slopes, torch.Tensor) or bias_slopes.numel() != heads:
            raise AttnScopeError(
                f"bias_slopes: expected one slope per query head ({heads}), got "
                f"{describe(bias_slopes)}"
            )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise AttnScopeError(f"scale: expected a number, got {describe(scale)}")
    _positive_int("block", block)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (queries, keys, values)):
        raise AttnScopeError(
            "blocked attention is computed without autograd (it is for inspection, and works "
            "its blocks in place): expected tensors that do not require grad, got some that do; "
            "call it under torch.no_grad(), or train with attend / scaled_dot_product_attention"
        )


class _Layout:
    """Queries as ``(B, K, G, T, D)`` and keys/values as ``(B, K, 1, S, D)``: grouped heads
    broadcast without copying the keys, and every other layout is a special case."""

    def __init__(self, queries, keys, values, bias_slopes):
        self.shape = queries.shape[:-2]
        q, k, v = queries, keys, values
        while q.dim() < 4:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        b, h, t, d = q.shape
        kv = k.shape[1]
        self.group = h // kv
        self.q = q.reshape(b, kv, self.group, t, d)
        self.k, self.v = k.unsqueeze(2), v.unsqueeze(2)
        self.slopes = None
        if bias_slopes is not None:  # (K, G, 1, 1), in float64 as alibi_bias makes it
            self.slopes = bias_slopes.to(torch.float64).reshape(kv, self.group, 1, 1)

    def restore(self, t: torch.Tensor, extra: int = 0) -> torch.Tensor:
        """``(B, K, G, T, ...)`` back to the queries' leading shape ``(..., T, ...)``."""
        tail = t.shape[t.dim() - extra :] if extra else ()
        return t.reshape(*self.shape, t.shape[3], *tail)


def _hidden(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, window: int | None):
    """``(bq, bk)`` bool, True where hidden, from positions; None when nothing is."""
    if not causal:
        return None
    d = qpos[:, None] - kpos[None, :]
    hide = d < 0
    if window is not None:
        hide = hide | (d >= window)
    return hide


def _hides_some(lo: int, hi: int, k0: int, k1: int, causal: bool, window: int | None) -> bool:
    """Whether the mask hides any key ``k0 .. k1 - 1`` from some query at positions
    ``lo .. hi``: only blocks across the diagonal (or a window's edge) need a mask built."""
    return causal and (k1 - 1 > lo or (window is not None and k0 <= hi - window))


def _bias_block(slopes, qpos, kpos, dtype):
    """ALiBi's ``-slope * |i - j|`` (``slope * (j - i)`` on the causal part) for a block,
    computed in float64 as :func:`~attnscope.functional.alibi_bias` does, then cast."""
    dist = (qpos[:, None] - kpos[None, :]).to(torch.float64).abs()
    return (-slopes * dist).to(dtype)


#: how many score entries one block may hold: 4M floats (16 MiB) stays in a server's cache,
#: where a (heads, 1024, 1024) block does not and costs twice the time on CPU
_BLOCK_ENTRIES = 1 << 22


class _TopK:
    """The ``k`` heaviest keys per query row, merged block by block.

    Only rows whose block maximum beats their current ``k``-th best are re-ranked: past the
    first few blocks that is a small share of the rows, and ``topk`` is the costly step."""

    def __init__(self, rows: int, k: int, dtype, device):
        self.k = k
        self.s = torch.full((rows, k), -torch.inf, dtype=dtype, device=device)
        self.j = torch.full((rows, k), -1, dtype=torch.long, device=device)

    def update(self, s: torch.Tensor, blk_max: torch.Tensor, k0: int) -> None:
        """``s``: ``(rows, bk)`` logits of keys ``k0 ..``; ``blk_max``: ``(rows,)``."""
        need = (blk_max > self.s[:, -1]).nonzero().squeeze(1)
        if need.numel() == 0:
            return
        sub = s.index_select(0, need) if need.numel() < s.shape[0] else s
        kk = min(self.k, sub.shape[-1])
        bs, bi = sub.topk(kk, dim=-1)
        # candidates in key order (earlier blocks first, then this block's by index), so that
        # a stable sort keeps the first of equal keys first
        bi, order = bi.sort(-1)
        bs = bs.gather(-1, order)
        cs = torch.cat([self.s.index_select(0, need), bs], -1)
        cj = torch.cat([self.j.index_select(0, need), bi + k0], -1)
        best_s, pick = cs.sort(dim=-1, descending=True, stable=True)
        self.s.index_copy_(0, need, best_s[:, : self.k])
        self.j.index_copy_(0, need, cj.gather(-1, pick[:, : self.k]))


def _run(
    queries,
    keys,
    values,
    *,
    causal,
    window,
    bias_slopes,
    scale,
    block,
    rows,
    summary_k,
):
    _check(queries, keys, values, causal, window, bias_slopes, scale, block)
    t_q, t_k = queries.shape[-2], keys.shape[-2]
    offset = t_k - t_q  # queries are the last t_q positions (a cache before them)
    device = queries.device
    if rows is not None:
        rows = check_rows(rows, t_q)
        queries = queries[..., list(rows), :]
        qpos_all = torch.tensor(rows, device=device) + offset
    else:
        qpos_all = torch.arange(offset, offset + t_q, device=device)
    lay = _Layout(queries, keys, values, bias_slopes)
    factor = keys.shape[-1] ** -0.5 if scale is None else float(scale)
    b, kv, g, n, d = lay.q.shape
    d_v = values.shape[-1]
    dtype = queries.dtype
    want = summary_k is not None
    q_all = lay.q
    k_all, v_all = lay.k.squeeze(2), lay.v.squeeze(2)  # (B, K, S, D): read in place
    # a query block's g heads share their kv head: (B, K, G * bq, D) @ (B, K, D, bk) needs no
    # copy of the keys per head
    bq_size = max(1, min(block, _BLOCK_ENTRIES // max(1, b * kv * g * block)))
    # tokens first in memory, so that merging the heads afterwards is a view, not a copy
    context = q_all.new_empty(b, n, kv, g, d_v).permute(0, 2, 3, 1, 4)
    if want:
        stats = {
            name: torch.empty(b, kv, g, n, dtype=dtype, device=device)
            for name in ("entropy", "max_weight", "sink_weight", "mean_distance", "logsumexp")
        }
        max_key = torch.empty(b, kv, g, n, dtype=torch.long, device=device)
        top_keys = torch.empty(b, kv, g, n, summary_k, dtype=torch.long, device=device)
        top_w = torch.empty(b, kv, g, n, summary_k, dtype=dtype, device=device)
    kpos_all = torch.arange(t_k, device=device)
    kpos_f = kpos_all.to(dtype)
    # chosen rows may be anywhere: order them so that a block of queries is contiguous in
    # position, which is what lets whole key blocks be skipped
    order = torch.argsort(qpos_all)
    contiguous = rows is None
    for start in range(0, n, bq_size):
        if contiguous:
            idx = slice(start, min(start + bq_size, n))
            qpos = qpos_all[idx]
        else:
            idx = order[start : start + bq_size]
            qpos = qpos_all[idx]
        bq = qpos.shape[0]
        # the scale goes into a block of queries rather than into every block of scores
        q = q_all[:, :, :, idx, :].reshape(b, kv, g * bq, d) * factor
        lo, hi = int(qpos[0]), int(qpos[-1])  # sorted
        k_first = 0 if window is None else max(0, lo - window + 1)
        k_last = hi + 1 if causal else t_k
        shape = (b, kv, g * bq, 1)
        m = torch.full(shape, -torch.inf, dtype=dtype, device=device)
        l = torch.zeros(shape, dtype=dtype, device=device)
        acc = torch.zeros((b, kv, g * bq, d_v), dtype=dtype, device=device)
        if want:
            t_sum = torch.zeros_like(l)  # sum_j p_j (s_j - m)
            u_sum = torch.zeros_like(l)  # sum_j p_j * j
            sink = torch.full(shape, -torch.inf, dtype=dtype, device=device)
            top = _TopK(b * kv * g * bq, summary_k, dtype, device)
        for k0 in range(k_first - k_first % block, k_last, block):
            k1 = min(k0 + block, k_last)
            bk = k1 - k0
            s = q @ k_all[:, :, k0:k1, :].transpose(-2, -1)  # (B, K, G * bq, bk)
            s5 = s.view(b, kv, g, bq, bk)
            if lay.slopes is not None:
                s5 += _bias_block(lay.slopes, qpos, kpos_all[k0:k1], dtype)
            hide = None
            if _hides_some(lo, hi, k0, k1, causal, window):
                hide = _hidden(qpos, kpos_all[k0:k1], causal, window)
                s5.masked_fill_(hide, -torch.inf)
            blk_max = s.amax(-1, keepdim=True)
            m_new = torch.maximum(m, blk_max)
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            if want:
                top.update(s.reshape(-1, bk), blk_max.reshape(-1), k0)
                if k0 == 0:
                    sink = s[..., :1].clone()
                shift = torch.where(l > 0, (m - m_safe) * l, torch.zeros_like(l))
                t_sum.add_(shift).mul_(alpha)
                s.sub_(m_safe)  # s - m: log p where a key is visible
                p = torch.exp(s)
                if hide is not None:  # 0 * -inf: hidden keys add nothing
                    s5.masked_fill_(hide, 0.0)
                t_sum += (p * s).sum(-1, keepdim=True)
                u_sum.mul_(alpha).add_(p @ kpos_f[k0:k1, None])
            else:
                p = s.sub_(m_safe).exp_()
            l.mul_(alpha).add_(p.sum(-1, keepdim=True))
            acc.mul_(alpha).add_(p @ v_all[:, :, k0:k1, :])
            m = m_new
        context[:, :, :, idx, :] = (acc / l).view(b, kv, g, bq, d_v)
        if want:
            m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            lead = (b, kv, g, bq)
            stats["entropy"][..., idx] = (torch.log(l) - t_sum / l).view(lead)
            stats["max_weight"][..., idx] = (1.0 / l).view(lead)
            stats["logsumexp"][..., idx] = (m + torch.log(l)).view(lead)
            top_s = top.s.view(*shape[:-1], -1)
            w_top = torch.exp(top_s - m_safe) / l
            keys_top = torch.where(w_top > 0, top.j.view(*shape[:-1], -1), -1)
            max_key[..., idx] = keys_top[..., 0].view(lead)
            top_keys[..., idx, :] = keys_top.view(*lead, -1)
            top_w[..., idx, :] = w_top.view(*lead, -1)
            stats["sink_weight"][..., idx] = (torch.exp(sink - m_safe) / l).view(lead)
            stats["mean_distance"][..., idx] = qpos.to(dtype) - (u_sum / l).view(lead)
    out = lay.restore(context, extra=1)
    if not want:
        return out, None
    summary = AttentionSummary(
        entropy=lay.restore(stats["entropy"]),
        max_weight=lay.restore(stats["max_weight"]),
        max_key=lay.restore(max_key),
        top_keys=lay.restore(top_keys, extra=1),
        top_weights=lay.restore(top_w, extra=1),
        sink_weight=lay.restore(stats["sink_weight"]),
        mean_distance=lay.restore(stats["mean_distance"]),
        positions=qpos_all - offset,
        logsumexp=lay.restore(stats["logsumexp"]),
    )
    return out, summary


def blocked_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    bias_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    block: int = 512,
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """The attention core over blocks of keys, never holding the ``(T, S)`` matrix.

    Args:
        queries: ``(..., T, D)``; ``...`` is ``()``, ``(B,)`` or ``(B, H)``.
        keys, values: ``(..., S, D)``; ``(B, K, S, D)`` with ``K`` dividing ``H`` are
            grouped heads (query head h reads key/value head ``h // (H // K)``), read in
            place, not repeated.
        causal: hide keys after each query (with ``S > T`` the queries are the last ``T``
            positions).
        window: with ``causal``, each query sees its last ``window`` keys, itself included.
        bias_slopes: ``(H,)`` ALiBi slopes: ``-slope * |i - j|`` added to the scaled scores
            (``slope * (j - i)`` on every key a causal query sees), as
            :func:`~attnscope.functional.alibi_bias`.
        scale: the factor the scores are multiplied by (default ``1 / sqrt(D)``).
        block: queries and keys per block; any positive size (it need not divide ``T``).
        rows: only these query positions (the result has ``len(rows)`` rows, in that order).

    Returns:
        ``(..., T, d_v)`` (or ``(..., len(rows), d_v)``): equal to
        :func:`~attnscope.functional.attend` and ``scaled_dot_product_attention`` to
        floating-point rounding. A query that sees no key gets NaN, as a softmax would.

    Computed without autograd: inputs that require grad are refused unless grad is off.
    """
    out, _ = _run(
        queries,
        keys,
        values,
        causal=causal,
        window=window,
        bias_slopes=bias_slopes,
        scale=scale,
        block=block,
        rows=rows,
        summary_k=None,
    )
    return out


def attention_summary(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    bias_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    block: int = 512,
    rows: Sequence[int] | None = None,
    k: int = 4,
) -> tuple[torch.Tensor, AttentionSummary]:
    """:func:`blocked_attention` and, from the same pass, every query's summary.

    Same arguments, and ``k``: how many of the heaviest keys to keep per query.

    Returns:
        ``(context, summary)``: the context ``(..., T, d_v)`` and an
        :class:`AttentionSummary` with fields ``(..., T)`` (``top_*``: ``(..., T, k)``).
    """
    _positive_int("k", k)
    return _run(
        queries,
        keys,
        values,
        causal=causal,
        window=window,
        bias_slopes=bias_slopes,
        scale=scale,
        block=block,
        rows=rows,
        summary_k=k,
    )


def summarize_weights(
    weights: torch.Tensor, k: int = 4, positions: Sequence[int] | torch.Tensor | None = None
) -> AttentionSummary:
    """:class:`AttentionSummary` from full weight rows ``(..., T, S)`` (small inputs).

    ``positions``: the query position of each row (default ``S - T .. S - 1``).
    """
    _positive_int("k", k)
    t, s = weights.shape[-2], weights.shape[-1]
    if positions is None:
        pos = torch.arange(s - t, s, device=weights.device)
    else:
        pos = torch.as_tensor(positions, device=weights.device)
    keys = torch.arange(s, device=weights.device)
    plogp = torch.where(weights > 0, weights * torch.log(weights), torch.zeros_like(weights))
    max_w, max_k = weights.max(-1)
    kk = min(k, s)
    top_w, top_k = weights.topk(kk, dim=-1)
    if kk < k:
        pad = (*top_w.shape[:-1], k - kk)
        top_w = torch.cat([top_w, top_w.new_zeros(pad)], -1)
        top_k = torch.cat([top_k, top_k.new_full(pad, -1)], -1)
    top_k = torch.where(top_w > 0, top_k, -1)
    return AttentionSummary(
        entropy=-plogp.sum(-1),
        max_weight=max_w,
        max_key=max_k,
        top_keys=top_k,
        top_weights=top_w,
        sink_weight=weights[..., 0],
        mean_distance=(weights * (pos[:, None] - keys[None, :]).to(weights.dtype)).sum(-1),
        positions=pos - (s - t),
    )


def attend_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rows: Sequence[int],
    *,
    causal: bool = False,
    window: int | None = None,
    bias_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    record: dict | None = None,
) -> dict[str, torch.Tensor]:
    """The matrix stages of the chosen query ``rows`` only, full key width: ``(..., R, S)``.

    ``scores``, ``scaled_scores``, ``biased_scores`` (with ``bias_slopes``),
    ``masked_scores`` (with ``causal``) and ``weights``, by the same operations as
    :func:`~attnscope.functional.attend` on those rows (so they equal its rows to rounding).
    Grouped keys ``(B, K, S, D)`` are repeated for their query heads.
    """
    t_q, t_k = queries.shape[-2], keys.shape[-2]
    rows = check_rows(rows, t_q)
    q = queries[..., list(rows), :]
    if keys.dim() == 4 and queries.dim() == 4 and keys.shape[1] != queries.shape[1]:
        keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
    out = {} if record is None else record
    scores = q @ keys.transpose(-2, -1)
    scaled = scores * scale if scale is not None else scores / keys.shape[-1] ** 0.5
    logits = scaled
    out[Stage.SCORES.value], out[Stage.SCALED_SCORES.value] = scores, scaled
    qpos = torch.tensor(rows, device=q.device) + (t_k - t_q)
    kpos = torch.arange(t_k, device=q.device)
    if bias_slopes is not None:
        heads = bias_slopes.numel()
        slopes = bias_slopes.to(torch.float64).reshape(heads, 1, 1)
        bias = _bias_block(slopes, qpos, kpos, torch.float64).to(scaled.dtype)
        logits = out[Stage.BIASED_SCORES.value] = scaled + bias.reshape(
            (heads, len(rows), t_k) if queries.dim() == 4 else (len(rows), t_k)
        )
    if causal:
        hide = _hidden(qpos, kpos, causal, window)
        fill = torch.zeros(hide.shape, dtype=scaled.dtype, device=scaled.device)
        logits = out[Stage.MASKED_SCORES.value] = logits + fill.masked_fill_(hide, -torch.inf)
    out[Stage.WEIGHTS.value] = torch.softmax(logits, dim=-1)
    return out
