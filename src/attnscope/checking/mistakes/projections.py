"""Mistakes made before the scores: projections with another's weights or bias, heads cut
from the wrong axis."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...stages import Stage
from ..reference import Mutation, split
from .base import Context, define

T = torch.Tensor
_QKV = (Stage.QUERIES, Stage.KEYS, Stage.VALUES)


# ------------------------------------------------------------------ wrong_projection


def _swaps(combined_qkv: bool) -> list[tuple[tuple[int, int, int], str]]:
    names = ("W_query", "W_key", "W_value")
    out = []
    for a in range(3):
        for b in range(3):
            for c in range(3):
                src = (a, b, c)
                # identity is the reference. Swapping queries and keys gives the same numbers
                # as keys times queries: with separate weights that reads as
                # scores_transposed; with one combined weight, as chunks taken in the
                # wrong order (wrong_projection).
                if src == (0, 1, 2) or (src == (1, 0, 2) and not combined_qkv):
                    continue
                wrong = [f"{_QKV[i].value} from {names[s]}" for i, s in enumerate(src) if s != i]
                out.append((src, ", ".join(wrong)))
    return out


def _biases(biases: tuple[T | None, T | None, T | None]) -> list[Mutation]:
    """A projection without its bias, every projection without one, or another's bias."""

    def shift(i: int, delta: T) -> Callable[[T, T, T], tuple[T, T, T]]:
        return lambda q, k, v: tuple(t + delta if j == i else t for j, t in enumerate((q, k, v)))

    out = []
    for i, bias in enumerate(biases):
        if bias is None:
            continue
        stage = _QKV[i]
        out.append(
            Mutation(
                "wrong_projection",
                stage,
                f"{stage} projected without their bias",
                qkv=shift(i, -bias),
            )
        )
        for j, other in enumerate(biases):
            if j != i and other is not None and other.shape == bias.shape:
                out.append(
                    Mutation(
                        "wrong_projection",
                        stage,
                        f"{stage} projected with the bias of the {_QKV[j]}",
                        qkv=shift(i, other - bias),
                    )
                )
    present = [b for b in biases if b is not None]
    if len(present) > 1:
        out.append(
            Mutation(
                "wrong_projection",
                next(st for st, b in zip(_QKV, biases, strict=True) if b is not None),
                "projections without their biases",
                qkv=lambda q, k, v: tuple(
                    t if b is None else t - b for t, b in zip((q, k, v), biases, strict=True)
                ),
            )
        )
    return out


@define(
    "wrong_projection",
    expected="expected queries = x @ W_query, keys = x @ W_key, values = x @ W_value",
)
def _wrong_projection(c: Context) -> list[Mutation]:
    if c.spec.simplified:
        return []
    out = [
        Mutation(
            "wrong_projection",
            next(_QKV[i] for i, s in enumerate(src) if s != i),
            label,
            qkv=lambda q, k, v, s=src: tuple((q, k, v)[i] for i in s),
        )
        for src, label in _swaps(c.combined_qkv)
    ]
    b = c.biases
    if all(t is not None for t in b) and len({t.shape for t in b}) == 1:
        # another projection's weight with the projection's own bias (a slice taken twice
        # from a packed weight whose biases are cut right)
        out += [
            Mutation(
                "wrong_projection",
                next(_QKV[i] for i, s in enumerate(src) if s != i),
                f"{label} (weights only; each keeps its own bias)",
                qkv=lambda q, k, v, s=src: tuple(
                    (q, k, v)[j] - b[j] + b[i] for i, j in enumerate(s)
                ),
            )
            for src, label in _swaps(c.combined_qkv)
        ]
    return out + _biases(b)


# ------------------------------------------------------------------ wrong_query_token

# the scores kind finds it directly (which token each call scored): see engine._scores
define("wrong_query_token", one_query_expected="Expected query = inputs[query_index]")


# ------------------------------------------------------------------ heads_split


def _split_tokens(t: T, heads: int) -> T:
    b, n, d = t.shape
    return t.reshape(b, heads, n, d // heads)


def _split_channels_first(t: T, heads: int) -> T:
    """Channels first ``(b, d, n)`` viewed as ``(b, heads, n, hd)`` with no transpose."""
    b, n, d = t.shape
    return t.transpose(1, 2).reshape(b, heads, n, d // heads)


def _split_interleaved(t: T, heads: int) -> T:
    b, n, d = t.shape
    return t.reshape(b, n, d // heads, heads).permute(0, 3, 1, 2)


def _merge_tokens(c: T) -> T:
    """The inverse of :func:`_split_tokens`: ``(B, H, T, hd) -> (B, T, H*hd)`` by reshape."""
    return c.reshape(c.shape[0], c.shape[2], -1)


def _merge_interleaved(c: T) -> T:
    """The inverse of :func:`_split_interleaved`."""
    return c.permute(0, 2, 3, 1).reshape(c.shape[0], c.shape[2], -1)


def _only(which: int, bad: Callable[[T, int], T]) -> Callable[[T, int], T]:
    """A split applied wrongly to one of queries/keys/values (by call order 0, 1, 2)."""
    calls = {"n": 0}

    def cut(t: T, heads: int) -> T:
        i = calls["n"] % 3
        calls["n"] += 1
        return bad(t, heads) if i == which else split(t, heads)

    return cut


@define(
    "heads_split",
    expected="expected (b, tokens, d_out) -> view(b, tokens, num_heads, head_dim) -> "
    "transpose(1, 2)",
)
def _heads_split(c: Context) -> list[Mutation]:
    if not (c.spec.multihead and c.spec.num_heads > 1):
        return []
    out = []
    inverses = {_split_tokens: _merge_tokens, _split_interleaved: _merge_interleaved}
    cuts = [(_split_tokens, "tokens"), (_split_interleaved, "interleaved features")]
    cuts.append((_split_channels_first, "the channels-first (b, d, tokens) layout"))
    for bad, how in cuts:
        q = Stage.QUERIES
        out.append(Mutation("heads_split", q, f"heads cut from {how} (all of q, k, v)", split=bad))
        if bad in inverses:  # the same wrong cut, undone consistently when the heads are merged
            out.append(
                Mutation(
                    "heads_split",
                    q,
                    f"heads cut from {how} (all of q, k, v), merged back the same way",
                    split=bad,
                    merge=inverses[bad],
                )
            )
        for i, stage in enumerate(_QKV):
            out.append(
                Mutation(
                    "heads_split", stage, f"heads of {stage} cut from {how}", split=_only(i, bad)
                )
            )
    if c.spec.kv == c.spec.num_heads:
        # (B, T, H, hd) never transposed: each token attends over its own heads
        def heads_kept(t: T, heads: int) -> T:
            return t.reshape(*t.shape[:2], heads, -1)

        for label, back in (
            ("transposed back", lambda t: t.transpose(1, 2).reshape(*t.shape[:2], -1)),
            ("merged as they are", lambda t: t.reshape(*t.shape[:2], -1)),
        ):
            out.append(
                Mutation(
                    "heads_split",
                    Stage.QUERIES,
                    "heads cut with the head axis left after the tokens ((b, tokens, heads, "
                    f"head_dim): each token attends over its own heads), {label}",
                    split=heads_kept,
                    merge=back,
                )
            )
    if c.combined_qkv and c.spec.kv == c.spec.num_heads:
        out += _fused_splits(c.spec.num_heads)
    if c.combined_kv and c.spec.kv > 1:
        out += _fused_kv_splits(c.spec.kv)
    return out


def _unsplit(h: T) -> T:
    """The inverse of the reference's split: ``(B, H, T, hd) -> (B, T, H*hd)``."""
    return h.transpose(1, 2).reshape(h.shape[0], h.shape[2], -1)


def _fused_kv_splits(heads: int) -> list[Mutation]:
    """:func:`_fused_splits` for one combined key/value projection ``(B, S, 2*D)``
    (``[k|v]`` blocks, or per head ``[k_h|v_h]``) reshaped heads-first, or pair-first
    ``(b, 2, heads, S, hd)``, before keys and values are cut from it: the keys show it first."""

    def pack(k: T, v: T, per_head: bool) -> T:
        b, n, d = k.shape
        if per_head:
            return torch.stack([t.view(b, n, heads, -1) for t in (k, v)], 3).reshape(b, n, -1)
        return torch.cat([k, v], -1)

    def cut(per_head: bool, heads_first: bool):
        def kv(q: T, k: T, v: T) -> tuple[T, T, T]:
            b, n, d = k.shape
            packed = pack(k, v, per_head)
            if heads_first:  # (B, H, S, 2*hd), then chunked on the last axis
                parts = packed.reshape(b, heads, n, -1).chunk(2, -1)
            else:  # (B, 2, H, S, hd), then unbound on the second
                parts = packed.reshape(b, 2, heads, n, -1).unbind(1)
            return (q, *(_unsplit(p) for p in parts))

        return kv

    out = []
    for heads_first in (True, False):
        shape = "(b, heads, tokens, 2*head_dim)" if heads_first else "(b, 2, heads, tokens, hd)"
        for per_head in (True, False):
            out.append(
                Mutation(
                    "heads_split",
                    Stage.KEYS,
                    f"the combined k/v projection's output reshaped straight to {shape}, "
                    "mixing tokens and features",
                    qkv=cut(per_head, heads_first),
                )
            )
    return out


def _fused_splits(heads: int) -> list[Mutation]:
    """One combined projection's output ``(B, T, 3*D)`` reshaped heads-first before q, k
    and v are cut from it: each cut mixes tokens, and the mixing reaches q, k and v
    together, so it is a mutation of all three at once (for either packing of the weight:
    per head ``[q_h|k_h|v_h]``, or ``[q|k|v]`` blocks)."""

    def pack(q: T, k: T, v: T, per_head: bool) -> T:
        b, n, d = q.shape
        if per_head:
            return torch.stack([t.view(b, n, heads, -1) for t in (q, k, v)], 3).reshape(b, n, -1)
        return torch.cat([q, k, v], -1)

    def cut(per_head: bool, heads_first: bool):
        def qkv(q: T, k: T, v: T) -> tuple[T, T, T]:
            b, n, d = q.shape
            packed = pack(q, k, v, per_head)
            if heads_first:  # (B, H, T, 3*hd), then chunked on the last axis
                parts = packed.reshape(b, heads, n, -1).chunk(3, -1)
            else:  # (B, 3, H, T, hd), then unbound on the second
                parts = packed.reshape(b, 3, heads, n, -1).unbind(1)
            return tuple(_unsplit(p) for p in parts)

        return qkv

    # both packings give the same raw output (each under its own reading of the weight),
    # so the label names the reshape, not the packing
    out = []
    for heads_first in (True, False):
        shape = "(b, heads, tokens, 3*head_dim)" if heads_first else "(b, 3, heads, tokens, hd)"
        for per_head in (True, False):
            out.append(
                Mutation(
                    "heads_split",
                    Stage.QUERIES,
                    f"the combined q/k/v projection's output reshaped straight to {shape}, "
                    "mixing tokens and features",
                    qkv=cut(per_head, heads_first),
                )
            )
    return out
