"""Mistakes of modern attention: rotary embeddings, QK norm, grouped key/value heads,
windows, ALiBi.

The rotation is the reference's :class:`..rotary.Rope` (the layer's own pairing and
frequencies, read from its computation); each mutation changes one thing about how it is
applied. Grouped heads: query head h must read key/value head ``h // group``.
"""

from __future__ import annotations

import torch

from ...stages import Stage
from ..alibi import Alibi, alibi_bias
from ..reference import Mutation, causal_hide, split, window_mask
from .base import Context, define
from .projections import only_one

_OTHER = {"half": "interleaved", "interleaved": "half"}


def _rope_expected(spec) -> str:
    r = spec.rope
    if r is None:
        return ""
    return (
        f"expected queries and keys rotated alike ({r.pairing} pairing, {r.rot} of "
        f"{r.head_dim} features per head) at positions 0..n-1"
    )


@define("rope_missing", expected=_rope_expected)
def _rope_missing(c: Context) -> list[Mutation]:
    if c.spec.rope is None:
        return []
    rope = c.spec.rope
    return [
        Mutation(
            "rope_missing",
            Stage.ROTATED_QUERIES,
            "the queries not rotated (the keys are)",
            rotate=lambda role, t: t if role == "q" else rope.rotate(t),
        ),
        Mutation(
            "rope_missing",
            Stage.ROTATED_KEYS,
            "the keys not rotated (the queries are)",
            rotate=lambda role, t: t if role == "k" else rope.rotate(t),
        ),
    ]


@define("rope_pairing", expected=_rope_expected)
def _rope_pairing(c: Context) -> list[Mutation]:
    rope = c.spec.rope
    if rope is None:
        return []
    other = _OTHER[rope.pairing]
    label = (
        f"cos/sin tables laid out for the {rope.pairing} pairing, applied with the {other} "
        "pairing's rotation"
    )
    out = [
        Mutation(
            "rope_pairing",
            Stage.ROTATED_QUERIES,
            label,
            rotate=lambda role, t: rope.rotate(t, pairing=other),
        ),
    ]
    for role, stage in (("q", Stage.ROTATED_QUERIES), ("k", Stage.ROTATED_KEYS)):
        side = "queries" if role == "q" else "keys"
        out.append(
            Mutation(
                "rope_pairing",
                stage,
                f"{label}, on the {side} only",
                rotate=lambda r, t, role=role: rope.rotate(t, pairing=other if r == role else None),
            )
        )
    return out


@define("rope_positions", expected=_rope_expected)
def _rope_positions(c: Context) -> list[Mutation]:
    rope = c.spec.rope
    if rope is None:
        return []
    out = []
    sides = [("q", Stage.ROTATED_QUERIES, "queries"), ("k", Stage.ROTATED_KEYS, "keys")]
    # a shift of one side against the other reads the same from either side: name the side
    # whose positions do not start where the other's do (and at 0) first
    q_off, k_off = rope.offsets
    if k_off is not None and q_off is not None and abs(k_off) > abs(q_off):
        sides.reverse()
    for role, stage, side in sides:
        for shift, where in ((1, "one ahead of"), (-1, "one behind")):
            out.append(
                Mutation(
                    "rope_positions",
                    stage,
                    f"the {side} rotated for positions {where} the other side's",
                    rotate=lambda r, t, role=role, shift=shift: rope.rotate(
                        t, offset=shift if r == role else 0
                    ),
                )
            )
    # the shift the tables themselves show, where it is more than one position (a table
    # sized for more positions, read from its tail for one side)
    if q_off is not None and k_off is not None and abs(round(q_off - k_off)) > 1:
        d = round(q_off - k_off)
        role, stage, side, shift = (
            ("q", Stage.ROTATED_QUERIES, "queries", d)
            if abs(q_off) >= abs(k_off)
            else ("k", Stage.ROTATED_KEYS, "keys", -d)
        )
        out.append(
            Mutation(
                "rope_positions",
                stage,
                f"the {side} rotated for positions {abs(shift)} "
                f"{'ahead of' if shift > 0 else 'behind'} the other side's",
                rotate=lambda r, t, role=role, shift=shift: rope.rotate(
                    t, offset=shift if r == role else 0
                ),
            )
        )
    if rope.scaled_side is not None:
        # the positions the tables themselves show on one side, scaled against the other's
        role, factor = rope.scaled_side
        stage, side = (
            (Stage.ROTATED_QUERIES, "queries") if role == "q" else (Stage.ROTATED_KEYS, "keys")
        )

        def scaled(r, t, role=role, factor=factor):
            if r != role:
                return rope.rotate(t)
            n = t.shape[-2]
            return rope.rotate(t, positions=torch.arange(n, dtype=torch.float64) * factor)

        out.append(
            Mutation(
                "rope_positions",
                stage,
                f"the {side} rotated at positions times {factor:g} (a position scaling "
                "applied to one side only)",
                rotate=scaled,
            )
        )

    if rope.by_head:
        # tables indexed along the head axis: every token of head h turned by h's angles
        def by_head(r, t):
            if r not in rope.by_head:
                return rope.rotate(t)
            heads = torch.arange(t.shape[-3], dtype=torch.float64)
            return rope.rotate(t.transpose(-3, -2), positions=heads).transpose(-3, -2)

        role = rope.by_head[0]
        side = "queries and keys" if len(rope.by_head) == 2 else {"q": "queries", "k": "keys"}[role]
        out.append(
            Mutation(
                "rope_positions",
                Stage.ROTATED_QUERIES if role == "q" else Stage.ROTATED_KEYS,
                f"the {side} rotated by their head's number, every token alike (the tables "
                "indexed along the head axis, not the tokens')",
                rotate=by_head,
            )
        )
    read = dict(rope.read_positions)
    if read:
        # the positions the tables show on a side that does not count 0, 1, 2, ... (a ring
        # buffer's slot, positions restarting each patch): that side rotated at them
        both = set(read) == {"q", "k"} and read["q"] == read["k"]

        def at_read(r, t):
            pos = read.get(r)
            if pos is None or len(pos) < t.shape[-2]:
                return rope.rotate(t)
            positions = torch.tensor(pos[: t.shape[-2]], dtype=torch.float64)
            return rope.rotate(t, positions=positions)

        role = "q" if "q" in read else "k"
        shown = ", ".join(f"{p:g}" for p in read[role][:10])
        side = "queries and keys" if both else "queries" if role == "q" else "keys"
        out.append(
            Mutation(
                "rope_positions",
                Stage.ROTATED_QUERIES if role == "q" else Stage.ROTATED_KEYS,
                f"the {side} rotated at positions {shown}, ... (not 0, 1, 2, ...)",
                rotate=at_read,
            )
        )

    def at_last(r, t):
        if r != "q":
            return rope.rotate(t)
        n = t.shape[-2]
        return rope.rotate(t, positions=torch.full((n,), n - 1, dtype=torch.float64))

    out.append(
        Mutation(
            "rope_positions",
            Stage.ROTATED_QUERIES,
            "every query rotated for the last position (a decoding step's position given to "
            "the whole prompt)",
            rotate=at_last,
        )
    )
    out.append(
        Mutation(
            "rope_positions",
            Stage.ROTATED_QUERIES,
            "positions counted backwards (n-1..0)",
            rotate=lambda r, t: rope.rotate(t.flip(-2)).flip(-2),
        )
    )
    out.append(
        Mutation(
            "rope_positions",
            Stage.ROTATED_QUERIES,
            "every token of sequence b rotated for position b: the tables' rows picked by "
            "the batch index, not the position (a sequence-first layout read batch-first)",
            rotate=lambda r, t: _by_sequence(rope, t),
        )
    )
    return out


def _by_sequence(rope, t: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, D)`` with every token of sequence b rotated for position b."""
    if t.dim() < 3:
        return rope.rotate(t, positions=torch.zeros(t.shape[-2], dtype=torch.float64))
    n = t.shape[-2]
    return torch.cat(
        [
            rope.rotate(t[i : i + 1], positions=torch.full((n,), float(i), dtype=torch.float64))
            for i in range(t.shape[0])
        ]
    )


@define("rope_on_values", expected="expected the values left unrotated: only queries and keys turn")
def _rope_on_values(c: Context) -> list[Mutation]:
    if c.spec.rope is None:
        return []
    keys_left = lambda role, t: t if role == "k" else c.spec.rope.rotate(t)  # noqa: E731
    return [
        Mutation("rope_on_values", Stage.VALUES, "the values rotated too", rotate_values=True),
        # ``q, v = rotary(q, v)``: the rotation handed the values in the keys' place
        Mutation(
            "rope_on_values",
            Stage.VALUES,
            "the values rotated in place of the keys (the keys left unrotated)",
            rotate_values=True,
            rotate=keys_left,
        ),
    ]


@define(
    "kv_group_mapping",
    expected=lambda spec: (
        f"expected query head h to read key/value head h // {spec.group} "
        "(repeat_interleave, or expand then reshape)"
    ),
)
def _kv_group_mapping(c: Context) -> list[Mutation]:
    s = c.spec
    if s.kv >= s.num_heads or s.kv <= 1:
        return []
    tiled = lambda t, g: t.repeat(1, g, 1, 1)  # noqa: E731  (head h reads h % kv_heads)
    right = lambda t, g: t.repeat_interleave(g, dim=1)  # noqa: E731
    return [
        Mutation(
            "kv_group_mapping",
            Stage.SCORES,
            f"query head h reading key/value head h % {s.kv} (repeat, not repeat_interleave)",
            expand_kv=tiled,
        ),
        Mutation(
            "kv_group_mapping",
            Stage.SCORES,
            f"query head h reading key head h % {s.kv} (the values grouped right)",
            expand_keys=tiled,
            expand_values=right,
        ),
        Mutation(
            "kv_group_mapping",
            Stage.CONTEXT,
            f"query head h reading value head h % {s.kv} (the keys grouped right)",
            expand_keys=right,
            expand_values=tiled,
        ),
        Mutation(
            "kv_group_mapping",
            Stage.SCORES,
            f"the query heads laid out as (heads per group, groups) and read as (groups, heads "
            f"per group): query head h reads key/value head h % {s.kv}, and the heads are "
            "merged back in that order",
            split=_queries_group_minor(s.num_heads // s.kv, s.kv),
        ),
    ]


def _queries_group_minor(per_group: int, groups: int):
    """A heads cut whose queries come out grouped the other way: position ``g * per_group +
    a`` holds projected head ``a * groups + g`` (an einops ``(hpg group dim)`` where ``(group
    hpg dim)`` was meant); keys and values cut right."""
    order = torch.tensor([a * groups + g for g in range(groups) for a in range(per_group)])
    return only_one(0, lambda t, heads: split(t, heads)[:, order])


def _window_expected(spec) -> str:
    w = spec.window
    if not w:
        return ""
    if not spec.causal:
        return (
            f"expected each query to see the keys within {(w - 1) // 2} positions on either "
            f"side, {w} keys with itself (the declared local window)"
        )
    return (
        f"expected each query to see its last {w} keys, itself included (the declared "
        f"sliding window), and no key after it"
    )


@define("window_missing", expected=_window_expected)
def _window_missing(c: Context) -> list[Mutation]:
    w = c.spec.window
    if not c.spec.causal:
        if not w or (w - 1) // 2 >= c.tokens - 1:
            return []  # a window as wide as the probe hides nothing
        return [
            Mutation(
                "window_missing",
                Stage.MASKED_SCORES,
                "no mask: every key seen",
                mask=lambda s: s,
            )
        ]
    if not w or w >= c.tokens:
        return []  # a window as long as the probe hides nothing more than the causal mask
    return [
        Mutation(
            "window_missing",
            Stage.MASKED_SCORES,
            "a causal mask without the window: every earlier key seen",
            mask=lambda s: s.masked_fill(causal_hide(s.shape[-1]), -torch.inf),
        )
    ]


@define("window_size", expected=_window_expected)
def _window_size(c: Context) -> list[Mutation]:
    w, causal, n = c.spec.window, c.spec.causal, c.tokens
    if not w:
        return []
    # the window the mask shows first, then those one or two keys off (a symmetric window
    # is off by a key on each side)
    others = [c.spec.window_seen] if c.spec.window_seen else []
    others += [w + 1, w - 1, w + 2, w - 2] if causal else [w + 2, w - 2]
    out = []
    for other in dict.fromkeys(o for o in others if o and o != w):
        if other < 1 or causal and not (other < n + 1 and min(w, n) != min(other, n)):
            continue
        if not torch.equal(window_mask(n, other, causal), window_mask(n, w, causal)):
            out.append(
                Mutation(
                    "window_size",
                    Stage.MASKED_SCORES,
                    f"a window of {other} keys where {w} are declared",
                    mask=lambda s, other=other: s.masked_fill(
                        window_mask(s.shape[-1], other, causal), -torch.inf
                    ),
                )
            )
    half = (w - 1) // 2
    if not causal and 1 < half < n - 1:
        # a local window one key short on one side only (tril/triu's diagonal off by one)
        for behind, ahead in ((half - 1, half), (half, half - 1)):
            out.append(
                Mutation(
                    "window_size",
                    Stage.MASKED_SCORES,
                    f"a window of {behind} keys behind each query and {ahead} ahead where "
                    f"{half} on either side are declared",
                    mask=lambda s, b=behind, a=ahead: s.masked_fill(
                        _band_hide(s.shape[-1], b, a, s.device), -torch.inf
                    ),
                )
            )
    return out


def _band_hide(n: int, behind: int, ahead: int, device) -> torch.Tensor:
    """``(n, n)`` True for the keys more than ``behind`` before or ``ahead`` after each
    query."""
    ones = torch.ones(n, n, dtype=torch.bool, device=device)
    return ones.triu(ahead + 1) | ones.tril(-behind - 1)


def _norm_expected(spec) -> str:
    n = spec.qk_norm
    if n is None:
        return ""
    over = "each head's features" if n.scope == "per-head" else "the whole projection"
    kind = "RMSNorm" if n.kind == "rms" else "LayerNorm"
    return f"expected the {kind} over {over} on both queries and keys, before the rotation"


@define("qk_norm_missing", expected=_norm_expected)
def _qk_norm_missing(c: Context) -> list[Mutation]:
    n = c.spec.qk_norm
    if n is None:
        return []
    return [
        Mutation(
            "qk_norm_missing",
            stage,
            f"the {side} not normed (the {other} are)",
            norm=lambda r, t, role=role: t if r == role else n.apply(r, t),
        )
        for role, stage, side, other in (
            ("q", Stage.NORMED_QUERIES, "queries", "keys"),
            ("k", Stage.NORMED_KEYS, "keys", "queries"),
        )
    ]


@define("qk_norm_misplaced", expected=_norm_expected)
def _qk_norm_misplaced(c: Context) -> list[Mutation]:
    if c.spec.qk_norm is None or c.spec.rope is None:
        return []
    return [
        Mutation(
            "qk_norm_misplaced",
            stage,
            f"the norm applied after the rotation{where}",
            norm_after_rope=frozenset(roles),
        )
        for roles, stage, where in (
            ("qk", Stage.NORMED_QUERIES, ""),
            ("q", Stage.NORMED_QUERIES, ", on the queries"),
            ("k", Stage.NORMED_KEYS, ", on the keys"),
        )
    ]


def _bias_expected(spec) -> str:
    a = spec.position_bias
    if a is None:
        return ""
    if not isinstance(a, Alibi):
        return "expected the layer's learned relative position bias added to every score"
    shown = ", ".join(f"{v:.4g}" for v in a.slopes[:4].tolist())
    more = ", ..." if a.heads > 4 else ""
    return (
        f"expected ALiBi's bias slope_h * (j - i) added to every score, with the geometric "
        f"slopes for {a.heads} heads ({shown}{more})"
    )


@define("bias_missing", expected=_bias_expected)
def _bias_missing(c: Context) -> list[Mutation]:
    if c.spec.position_bias is None:
        return []
    return [
        Mutation(
            "bias_missing", Stage.BIASED_SCORES, "no position bias added", bias=lambda h, n: None
        )
    ]


@define("bias_slopes", expected=_bias_expected)
def _bias_slopes(c: Context) -> list[Mutation]:
    a = c.spec.position_bias
    if not isinstance(a, Alibi):  # a learned bias has no standard slopes to hold it to
        return []
    std = a.slopes
    h = a.heads
    variants = {}
    if a.seen is not None and a.seen.shape == std.shape:
        seen = a.seen.abs()
        if not torch.allclose(seen, std, rtol=1e-3):
            variants["the slopes it uses: " + ", ".join(f"{v:.4g}" for v in seen[:4].tolist())] = (
                seen
            )
    # the power-of-two formula applied to any head count, and the slopes in reverse order
    variants["2^(-8 (h + 1) / heads) for a head count that is not a power of two"] = torch.tensor(
        [2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float64
    )
    variants["the slopes in reverse head order"] = std.flip(0)
    out = []
    for label, slopes in variants.items():
        if torch.allclose(slopes, std):
            continue
        out.append(
            Mutation(
                "bias_slopes",
                Stage.BIASED_SCORES,
                label,
                bias=lambda heads, n, s=slopes: alibi_bias(s, n, a.symmetric),
            )
        )
    return out


@define("bias_sign", expected=_bias_expected)
def _bias_sign(c: Context) -> list[Mutation]:
    a = c.spec.position_bias
    if not isinstance(a, Alibi):
        return []
    return [
        Mutation(
            "bias_sign",
            Stage.BIASED_SCORES,
            "the bias with its sign flipped: distant keys favoured",
            bias=lambda h, n: -alibi_bias(a.slopes, n, a.symmetric),
        ),
        Mutation(
            "bias_sign",
            Stage.BIASED_SCORES,
            "slope * |i - j| added: distant keys favoured",
            bias=lambda h, n: alibi_bias(a.slopes, n).abs(),
        ),
    ]


@define(
    "wrong_source",
    expected="expected queries from the input and keys and values from the other sequence "
    "(the encoder's output, the image features)",
)
def _wrong_source(c: Context) -> list[Mutation]:
    if not c.spec.kind.cross:
        return []
    return [
        Mutation(
            "wrong_source",
            Stage.KEYS,
            "keys and values projected from the queries' own input, not the other sequence",
            kv_from_queries=True,
        ),
        Mutation(
            "wrong_source",
            Stage.KEYS,
            "keys projected from the queries' own input, not the other sequence",
            from_queries="k",
        ),
        Mutation(
            "wrong_source",
            Stage.VALUES,
            "values projected from the queries' own input, not the other sequence",
            from_queries="v",
        ),
    ]
