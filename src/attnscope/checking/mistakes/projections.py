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
    if c.spec.kv != c.spec.num_heads:
        # grouped heads: the keys or values cut from the query projection's first columns
        # (a packed qkv sliced at offset 0 for the keys), as wide as the keys are
        out += [
            Mutation(
                "wrong_projection",
                _QKV[1],
                "keys from W_query (its first key-width columns)",
                qkv=lambda q, k, v: (q, q[..., : k.shape[-1]], v),
            ),
            Mutation(
                "wrong_projection",
                _QKV[2],
                "values from W_query (its first value-width columns)",
                qkv=lambda q, k, v: (q, k, q[..., : v.shape[-1]]),
            ),
        ]
    if c.spec.kind.cross:
        # keys or values made from the other sequence with another role's weights: the
        # swaps above take the queries' projection of the queries' own input
        names = {"q": "W_query", "k": "W_key", "v": "W_value"}
        out += [
            Mutation(
                "wrong_projection",
                _QKV[1] if role == "k" else _QKV[2],
                f"{'keys' if role == 'k' else 'values'} from {names[frm]} (applied to the "
                "other sequence)",
                reweigh=((role, frm),),
            )
            for role, frm in (("k", "q"), ("k", "v"), ("v", "q"), ("v", "k"))
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


def _split_tokens_first(t: T, heads: int) -> T:
    """Tokens first ``(n, b, d)`` (fairseq's time-major layout) viewed straight as
    ``(b * heads, n, hd)``, with no transpose through the tokens: rows of other tokens and
    sequences mixed into each head."""
    b, n, d = t.shape
    return t.transpose(0, 1).reshape(b, heads, n, d // heads)


def _split_interleaved(t: T, heads: int) -> T:
    b, n, d = t.shape
    return t.reshape(b, n, d // heads, heads).permute(0, 3, 1, 2)


#: the ways heads are cut wrongly from ``(b, tokens, d)``, each ``(t, heads) -> (b, heads,
#: tokens, hd)``
WRONG_CUTS = (_split_tokens, _split_interleaved, _split_channels_first)


def _merge_tokens(c: T) -> T:
    """The inverse of :func:`_split_tokens`: ``(B, H, T, hd) -> (B, T, H*hd)`` by reshape."""
    return c.reshape(c.shape[0], c.shape[2], -1)


def _merge_interleaved(c: T) -> T:
    """The inverse of :func:`_split_interleaved`."""
    return c.permute(0, 2, 3, 1).reshape(c.shape[0], c.shape[2], -1)


def _merge_head_major(c: T) -> T:
    """``(B, H, T, hd)`` whose ``B * H`` rows, batch-major, are read back head-major (the
    Set Transformer's ``cat(O.split(B, 0), 2)`` after a ``reshape(B * H, -1, hd)`` cut)."""
    b, h, n, e = c.shape
    return c.reshape(h, b, n, e).permute(1, 2, 0, 3).reshape(b, n, h * e)


def only_one(which: int, bad: Callable[[T, int], T]) -> Callable[[T, int], T]:
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
    cuts.append((_split_tokens_first, "the tokens-first (tokens, b, d) layout, no transpose"))
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
                    "heads_split", stage, f"heads of {stage} cut from {how}", split=only_one(i, bad)
                )
            )
    out.append(
        Mutation(
            "heads_split",
            Stage.QUERIES,
            "heads cut from tokens by reshape(b * heads, tokens, head_dim) (all of q, k, v), "
            "merged back as if cut head-major (split(b, 0), cat on the features)",
            split=_split_tokens,
            merge=_merge_head_major,
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
    """One combined key/value projection ``(B, S, 2*D)`` reshaped wrongly before keys and
    values are cut from it (see :func:`_packed_splits`): the keys show it first."""
    return _packed_splits(heads, "kv", Stage.KEYS)


def _fused_splits(heads: int) -> list[Mutation]:
    """One combined q/k/v projection ``(B, T, 3*D)`` reshaped wrongly before q, k and v
    are cut from it (see :func:`_packed_splits`): the queries show it first."""
    return _packed_splits(heads, "qkv", Stage.QUERIES)


def _packed_splits(heads: int, roles: str, stage: Stage) -> list[Mutation]:
    """One combined projection of ``roles`` (``"qkv"`` or ``"kv"``) reshaped heads-first
    ``(b, heads, tokens, parts*hd)`` and chunked, or ``(b, parts, heads, tokens, hd)`` or
    ``(parts, b, heads, tokens, hd)`` and unbound, straight from ``(B, T, parts*D)``: each
    cut mixes tokens, and the mixing reaches every role the projection makes at once. Both
    packings of the weight (per head ``[q_h|k_h|v_h]``, or blocks ``[q|k|v]``) give the
    same raw output, each under its own reading of the weight, so the label names the
    reshape, not the packing."""
    parts = len(roles)
    what = "q/k/v" if roles == "qkv" else "k/v"
    out = []
    for layout, shape in (
        ("heads_first", f"(b, heads, tokens, {parts}*head_dim)"),
        ("parts_second", f"(b, {parts}, heads, tokens, hd)"),
        ("parts_first", f"({parts}, b, heads, tokens, hd)"),
    ):
        for per_head in (True, False):
            out.append(
                Mutation(
                    "heads_split",
                    stage,
                    f"the combined {what} projection's output reshaped straight to {shape}, "
                    "mixing tokens and features",
                    qkv=packed_cut(heads, roles, per_head, layout),
                )
            )
    return out


def packed_cut(heads: int, roles: str, per_head: bool, layout: str):
    """``(q, k, v) -> (q, k, v)`` as one combined projection of ``roles`` reshaped wrongly
    gives them (see :func:`_packed_splits`), each back in ``(B, T, D)``."""
    parts = len(roles)

    def pack(ts: list[T]) -> T:
        b, n, _ = ts[0].shape
        if per_head:
            return torch.stack([t.view(b, n, heads, -1) for t in ts], 3).reshape(b, n, -1)
        return torch.cat(ts, -1)

    def mutate(q: T, k: T, v: T) -> tuple[T, T, T]:
        given = dict(zip("qkv", (q, k, v), strict=True))
        b, n, _ = given[roles[0]].shape
        packed = pack([given[r] for r in roles])
        if layout == "heads_first":
            pieces = packed.reshape(b, heads, n, -1).chunk(parts, -1)
        elif layout == "parts_second":
            pieces = packed.reshape(b, parts, heads, n, -1).unbind(1)
        else:  # VGGT's slip: qkv.reshape(3, B, heads, N, hd), the permute left out
            pieces = packed.reshape(parts, b, heads, n, -1).unbind(0)
        given.update({r: _unsplit(p) for r, p in zip(roles, pieces, strict=True)})
        return given["q"], given["k"], given["v"]

    return mutate


#: the wrong reshapes of one combined q/k/v projection, as ``(q, k, v) -> (q, k, v)``
def packed_scrambles(heads: int) -> list:
    return [
        packed_cut(heads, "qkv", per_head, layout)
        for layout in ("heads_first", "parts_second", "parts_first")
        for per_head in (True, False)
    ]
