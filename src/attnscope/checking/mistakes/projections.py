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
    for bad, how in ((_split_tokens, "tokens"), (_split_interleaved, "interleaved features")):
        q = Stage.QUERIES
        out.append(Mutation("heads_split", q, f"heads cut from {how} (all of q, k, v)", split=bad))
        out.append(  # the same wrong cut, undone consistently when the heads are merged
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
    return out
