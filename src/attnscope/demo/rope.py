"""Rotary position embeddings (RoPE): queries and keys turned by their position.

On a :class:`~attnscope.GroupedQueryAttention`'s own queries and keys: the rotation keeps
every pair's length and leaves position 0 alone; the scores then depend on the distance
between two tokens only; the two pairings (half, interleaved) are both rotations but other
numbers, and mixing one's tables with the other's rotation is not a rotation at all; a
partial rotation passes the rest of each head through.
"""

from __future__ import annotations

import copy

import torch

from .. import functional as AF
from ..grouped import GroupedQueryAttention
from ..lesson import Check, Shown, Step
from ..stages import Stage
from ..trace import ShapeCheck, Trace
from .checks import (
    agree,
    forward_stages,
    matrix_note,
    maxdiff,
    rows_of,
    seeded,
    shapes,
    show,
    trace_rows,
    walk_check,
)

PART = "rope"
SEED = 123  # the book's seed, as in the other parts
D_OUT, HEADS = 16, 2  # head_dim 8: four rotated pairs per head
SHIFT = 100  # positions added to every token to show that only distances count
FRACTION = 0.5  # the partial rotation's share of each head (GPT-NeoX's rotary_pct)


def walk(
    x: torch.Tensor, labels: tuple[str, ...], t: int, is_book: bool, seed: int | None, rows=None
):
    """RoPE in a GroupedQueryAttention on ``x`` ``(T, d_in)``: ``(steps, trace)``;
    ``rows``: row traces of those queries (a long input)."""
    s = SEED if seed is None else seed
    with seeded(s):
        layer = GroupedQueryAttention(x.shape[-1], D_OUT, HEADS)
    layer.eval()
    tr = trace_rows(layer, x, labels, rows)
    steps = [
        _rotate(tr, layer, s),
        _rotated_scores(tr, layer, x, t),
        _distance_only(tr, layer, t),
        _pairings(tr, layer),
        _mixed_tables(tr, layer),
        _partial(tr, x, s, rows),
    ]
    return steps, tr


# --- small pieces -----------------------------------------------------------------------------


def _pair_lengths(v: torch.Tensor, pairing: str, rot: int) -> torch.Tensor:
    """``(..., R/2)`` the length of every rotated pair of ``v`` ``(..., D)``."""
    part = v[..., :rot].double()
    if pairing == "half":
        a, b = part[..., : rot // 2], part[..., rot // 2 :]
    else:
        a, b = part[..., 0::2], part[..., 1::2]
    return torch.sqrt(a * a + b * b)


def _moved(tr: Trace) -> tuple[slice, str]:
    """The tokens whose position turns them (all but position 0), and what to call them."""
    return slice(1, None), f"positions 1..{tr.dims.tokens - 1}"


def _skip(name: str, why: str) -> Check:
    return Check(name, True, f"skipped: {why}")


def _length_kept(name: str, before: torch.Tensor, after: torch.Tensor, pairing: str, rot: int):
    b, a = _pair_lengths(before, pairing, rot), _pair_lengths(after, pairing, rot)
    return agree(name, a, b, f"lengths of {b.numel()} pairs before and after", atol=1e-6)


def _rotate_half(v: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``: ``(x1, x2) -> (-x2, x1)`` on the two halves."""
    half = v.shape[-1] // 2
    return torch.cat([-v[..., half:], v[..., :half]], dim=-1)


def _rotate_pairs(v: torch.Tensor) -> torch.Tensor:
    """GPT-J's ``rotate_every_two``: ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``."""
    return torch.stack([-v[..., 1::2], v[..., 0::2]], dim=-1).flatten(-2)


def _tables(angles: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, D)`` cos and sin tables laid out for one pairing: ``cat(a, a)`` for half,
    every angle twice in a row (``repeat_interleave``) for interleaved."""
    full = torch.cat([angles, angles], -1) if layout == "half" else angles.repeat_interleave(2, -1)
    return full.cos(), full.sin()


def _with_tables(v: torch.Tensor, angles: torch.Tensor, layout: str, rotation: str):
    """``v * cos + rotate(v) * sin`` with tables laid out for ``layout``, in float64."""
    cos, sin = _tables(angles, layout)
    v = v.double()
    turned = _rotate_half(v) if rotation == "half" else _rotate_pairs(v)
    return v * cos + turned * sin


# --- the steps --------------------------------------------------------------------------------


def _rotate(tr: Trace, layer: GroupedQueryAttention, seed: int) -> Step:
    d, head_dim = tr.dims, layer.head_dim
    rot = 2 * layer.inv_freq.shape[0]
    angles = AF.rope_angles(d.tokens, layer.inv_freq)
    q, rq = tr["queries"], tr["rotated_queries"]
    checks = [
        agree(
            "rotated_queries and rotated_keys are apply_rope(queries / keys, angles)",
            torch.cat([rq.flatten(), tr["rotated_keys"].flatten()]),
            torch.cat(
                [
                    AF.apply_rope(q.double(), angles).flatten(),
                    AF.apply_rope(tr["keys"].double(), angles).flatten(),
                ]
            ),
            "the trace vs functional.apply_rope in float64",
            atol=1e-6,
        ),
        _length_kept(
            "every pair keeps its length: a rotation",
            torch.cat([q.flatten(0, -2), tr["keys"].flatten(0, -2)]),
            torch.cat([rq.flatten(0, -2), tr["rotated_keys"].flatten(0, -2)]),
            "half",
            rot,
        ),
        agree(
            "position 0 is not turned: the identity",
            rq[..., 0, :],
            q[..., 0, :],
            "rotated_queries vs queries at position 0",
            atol=0.0,
        ),
    ]
    return Step(
        PART,
        "Rotate queries and keys by their position: rotated_queries, rotated_keys",
        f"torch.manual_seed({seed}); GroupedQueryAttention(d_in={d.d_in}, d_out={D_OUT}, "
        f"num_heads={HEADS}): RoPE on, pairing 'half', base {layer.rope_base:g}. Predict: "
        f"the shapes of queries and keys; feature i of each head turns with feature "
        f"i + {head_dim // 2} by position * base**(-2i/{head_dim}) radians, so every pair "
        "keeps its length and position 0 (angle 0) does not move.",
        shapes(tr, ("queries", "keys", "rotated_queries", "rotated_keys")),
        [
            Shown("frequencies (radians per position)", layer.inv_freq.double()),
            Shown(
                "angles = position * frequency",
                angles,
                tr.labels,
                tuple(f"pair {i}" for i in range(rot // 2)),
            ),
            show("queries, head 0", q[0], tr),
            show("rotated_queries, head 0", rq[0], tr),
        ],
        checks,
    )


def _rotated_scores(tr: Trace, layer: GroupedQueryAttention, x: torch.Tensor, t: int) -> Step:
    # the rows the trace keeps (every row, or a long input's chosen ones) against every key
    rq, rk = rows_of(tr, tr["rotated_queries"]), tr["rotated_keys"]
    scores = rq.double() @ rk.double().transpose(-2, -1)
    plain = rows_of(tr, tr["queries"]).double() @ tr["keys"].double().transpose(-2, -1)
    bound = rq.double().abs() @ rk.double().abs().transpose(-2, -1)
    checks = [
        agree(
            "scores are rotated_queries @ rotated_keys.T",
            tr["scores"],
            scores,
            "the trace's scores vs the product in float64",
            atol=1e-6 * bound,
        )
    ]
    name = "they are not the unrotated queries @ keys.T"
    if tr.dims.tokens > 1 and bound.max() > 1e-12:
        gap = maxdiff(tr["scores"], plain)
        checks.append(Check(name, gap > 1e-4 * bound.max().item(), f"max |difference| {gap:.4f}"))
    else:
        why = "every score is 0" if tr.dims.tokens > 1 else "one token, at position 0"
        checks.append(_skip(name, f"{why}: nothing to tell apart"))
    # in float64: float32's rounding of the angles at position 100 is not the property
    # checked, and large scores (large inputs) magnify it through a sharp softmax
    wide = copy.deepcopy(layer).double()
    with torch.no_grad():
        shifted, out = wide(x.double(), offset=SHIFT), wide(x.double())
    checks += [
        agree(
            f"every position shifted by {SHIFT}: the output does not change",
            shifted,
            out,
            f"layer(x, offset={SHIFT}) vs layer(x), in float64",
            atol=1e-9 * out.abs().max().item() + 1e-12,
        ),
        walk_check(tr, t),
    ]
    return Step(
        PART,
        "Scores from the rotated queries and keys",
        f"Predict: the scores use the rotated vectors{matrix_note(tr)}, so they differ from "
        "queries @ keys.T; "
        f"starting the sequence at position {SHIFT} instead of 0 turns every query and key "
        "further, but the output stays the same, because only distances count.",
        shapes(tr, ("scores",)),
        [show("scores, head 0", tr["scores"][0], tr, square=True)],
        checks,
    )


def _distance_only(tr: Trace, layer: GroupedQueryAttention, t: int) -> Step:
    q, k = tr["queries"][0, t].double(), tr["keys"][0, 0].double()
    freqs = layer.inv_freq.double()

    def score(m: int, n: int) -> float:
        rq = AF.apply_rope(q.view(1, -1), AF.rope_angles(1, freqs, m))
        rk = AF.apply_rope(k.view(1, -1), AF.rope_angles(1, freqs, n))
        return (rq @ rk.T).item()

    m, n = t, 0
    same = [(m + s, n + s) for s in (0, 1, 10, SHIFT)]
    one = [(m + 1, n), (m, n + 1)]
    values = {p: score(*p) for p in same + one}
    scale = (q.norm() * k.norm()).item()
    base = values[(m, n)]
    drift = max(abs(values[p] - base) for p in same)
    checks = [
        Check(
            "shifting both positions by the same amount keeps the score",
            drift <= 1e-9 * scale + 1e-12,
            f"(m, n) = {', '.join(f'({a}, {b})' for a, b in same)}: max |difference| {drift:.1e}",
        )
    ]
    name = "shifting only one of them changes it"
    if scale > 1e-6:
        moved = min(abs(values[p] - base) for p in one)
        checks.append(
            Check(
                name,
                moved > 1e-6 * scale,
                f"(m + 1, n) and (m, n + 1): smallest |difference| {moved:.4f}",
            )
        )
    else:
        checks.append(_skip(name, "the query or the key is zero: every score is 0"))
    cols = tuple(f"({a},{b})" for a, b in same + one)
    return Step(
        PART,
        "A rotated score depends on the distance only",
        f"The query of token {t} ({tr.labels[t]!r}, head 0) at position m and the key of "
        f"token 0 ({tr.labels[0]!r}) at position n, each turned by its position, in float64. "
        "Predict: rotating both by the same extra amount changes nothing (the score is a "
        "function of m - n); moving only one changes the score.",
        [],
        [
            Shown(
                "score at positions (m, n)",
                torch.tensor([values[p] for p in same + one]),
                None,
                cols,
            )
        ],
        checks,
    )


def _pairings(tr: Trace, layer: GroupedQueryAttention) -> Step:
    rot = 2 * layer.inv_freq.shape[0]
    angles = AF.rope_angles(tr.dims.tokens, layer.inv_freq)
    q = tr["queries"].double()
    half = AF.apply_rope(q, angles, "half")
    inter = AF.apply_rope(q, angles, "interleaved")
    pairs = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2).contiguous())
    turn = torch.polar(torch.ones_like(angles), angles)
    complex_way = torch.view_as_real(pairs * turn).flatten(-2)
    checks = [
        _length_kept("half keeps the length of every pair (i, i + D/2)", q, half, "half", rot),
        _length_kept(
            "interleaved keeps the length of every pair (2i, 2i + 1)", q, inter, "interleaved", rot
        ),
        agree(
            "interleaved is Meta's complex-number rotation",
            inter,
            complex_way,
            "apply_rope(..., 'interleaved') vs view_as_complex(pairs) * exp(i angle)",
            atol=1e-9,
        ),
    ]
    name = "the two pairings give other numbers"
    moved, where = _moved(tr)
    if tr.dims.tokens > 1 and q[..., moved, :].abs().max() > 1e-6:
        gap = maxdiff(half[..., moved, :], inter[..., moved, :])
        checks.append(Check(name, gap > 1e-4, f"{where}: max |difference| {gap:.4f}"))
    else:
        checks.append(_skip(name, "no token past position 0 with a non-zero query"))
    return Step(
        PART,
        "Two pairings: half (Hugging Face, the book) and interleaved (Meta, GPT-J)",
        f"head_dim {layer.head_dim}. 'half' turns feature i with i + {layer.head_dim // 2}; "
        "'interleaved' turns 2i with 2i + 1 (pairs of complex numbers). Predict: both are "
        "rotations (their own pairs keep their lengths), but they pair other features, so "
        "the numbers differ: a checkpoint trained with one needs the same pairing.",
        [ShapeCheck("interleaved", tuple(q.shape), tuple(inter.shape), "same shape as queries")],
        [show("interleaved, head 0 (half: rotated_queries above)", inter[0], tr)],
        checks,
    )


def _mixed_tables(tr: Trace, layer: GroupedQueryAttention) -> Step:
    angles = AF.rope_angles(tr.dims.tokens, layer.inv_freq)
    q = tr["queries"].double()
    checks = [
        agree(
            "cat(angles, angles) tables with rotate_half are the half pairing",
            _with_tables(q, angles, "half", "half"),
            AF.apply_rope(q, angles, "half"),
            "q * cos + rotate_half(q) * sin vs apply_rope(..., 'half')",
            atol=1e-9,
        ),
        agree(
            "repeat_interleave(angles, 2) tables with rotate_every_two are the interleaved pairing",
            _with_tables(q, angles, "interleaved", "interleaved"),
            AF.apply_rope(q, angles, "interleaved"),
            "q * cos + rotate_every_two(q) * sin vs apply_rope(..., 'interleaved')",
            atol=1e-9,
        ),
    ]
    length = q.norm(dim=-1)
    ratios = {}
    for tables, rotation in (("half", "interleaved"), ("interleaved", "half")):
        mixed = _with_tables(q, angles, tables, rotation)
        ratios[tables] = mixed.norm(dim=-1) / length.clamp_min(1e-30)
    name = "mixing one layout's tables with the other's rotation changes lengths: not a rotation"
    moved, where = _moved(tr)
    if tr.dims.tokens > 1 and length[..., moved].min() > 1e-6:
        worst = {k: (r[..., moved] - 1).abs().max().item() for k, r in ratios.items()}
        checks.append(
            Check(
                name,
                min(worst.values()) > 1e-3,
                f"{where}: half tables with rotate_every_two change a length by up to "
                f"{100 * worst['half']:.1f}%, interleaved tables with rotate_half by up to "
                f"{100 * worst['interleaved']:.1f}%",
            )
        )
    else:
        checks.append(_skip(name, "no token past position 0 with a non-zero query"))
    checks.append(_mixed_distance(tr, layer))
    return Step(
        PART,
        "The classic bug: tables laid out for one pairing, rotation of the other",
        "Hugging Face lays cos and sin out as cat(angles, angles) for rotate_half; the "
        "interleaved layout repeats every angle twice in a row for rotate_every_two. "
        "Predict: each layout with its own rotation is the pairing above; half tables with "
        "the interleaved rotation turn the two features of a pair by different angles, so "
        "lengths change (and scores no longer depend on distance alone).",
        [],
        [
            Shown(
                "length after / before, half tables + rotate_every_two, head 0",
                ratios["half"][0],
                None,
                tr.labels,
            )
        ],
        checks,
    )


def _mixed_distance(tr: Trace, layer: GroupedQueryAttention) -> Check:
    """With half tables and the interleaved rotation, a score at (1, 0) and at (11, 10)
    differ: the distance alone no longer decides it."""
    q, k = tr["queries"][0, 0].double(), tr["keys"][0, 0].double()

    def score(m: int, n: int) -> float:
        turn = [
            _with_tables(v.view(1, -1), AF.rope_angles(1, layer.inv_freq, p), "half", "interleaved")
            for v, p in ((q, m), (k, n))
        ]
        return (turn[0] @ turn[1].T).item()

    name = "... and with them a score depends on more than the distance"
    scale = (q.norm() * k.norm()).item()
    if scale <= 1e-6:
        return _skip(name, "the query or the key of token 0 is zero: every score is 0")
    near, far = score(1, 0), score(11, 10)
    return Check(
        name,
        abs(near - far) > 1e-6 * scale,
        f"token 0's query and key at positions (1, 0): {near:.4f}; at (11, 10): {far:.4f}",
    )


def _partial(tr: Trace, x: torch.Tensor, seed: int, rows=None) -> Step:
    """A partial rotation's queries and keys beside ``tr``'s (same sizes, same labels);
    ``rows``: a long input, whose other forward pass is computed for those rows only."""
    with seeded(seed):
        layer = GroupedQueryAttention(x.shape[-1], D_OUT, HEADS, rope_fraction=FRACTION)
    layer.eval()
    stages = forward_stages(layer, x, rows)  # queries and keys are whole either way
    rot = 2 * layer.inv_freq.shape[0]
    q, rq = stages["queries"], stages["rotated_queries"]
    untouched = torch.equal(rq[..., rot:], q[..., rot:]) and torch.equal(
        stages["rotated_keys"][..., rot:], stages["keys"][..., rot:]
    )
    checks = [
        Check(
            f"features {rot}..{layer.head_dim - 1} of every head pass through untouched",
            untouched,
            "rotated_queries / rotated_keys vs queries / keys there: bit for bit "
            + ("equal" if untouched else "different"),
        ),
        _length_kept(
            f"features 0..{rot - 1} turn in pairs (i, i + {rot // 2})", q, rq, "half", rot
        ),
    ]
    name = f"features 0..{rot - 1} do turn"
    moved, where = _moved(tr)
    if tr.dims.tokens > 1 and q[..., moved, :rot].abs().max() > 1e-6:
        gap = maxdiff(rq[..., moved, :rot], q[..., moved, :rot])
        checks.append(Check(name, gap > 1e-4, f"{where}: max |difference| {gap:.4f}"))
    else:
        checks.append(_skip(name, "no token past position 0 with a non-zero query"))
    return Step(
        PART,
        f"A partial rotation: rope_fraction={FRACTION} (GPT-NeoX's rotary_pct)",
        f"torch.manual_seed({seed}); GroupedQueryAttention(..., rope_fraction={FRACTION}). "
        f"Predict: {rot} of the {layer.head_dim} features of each head turn "
        f"({rot // 2} frequencies), the other {layer.head_dim - rot} are left as they are.",
        [
            ShapeCheck(
                "inv_freq",
                (int(layer.head_dim * FRACTION) // 2,),
                tuple(layer.inv_freq.shape),
                "one frequency per rotated pair: head_dim * fraction / 2",
            ),
            ShapeCheck(
                "rotated_queries",
                tr.predicted_shape("rotated_queries"),
                tuple(rq.shape),
                Stage.ROTATED_QUERIES.rule,
            ),
        ],
        [show("rotated_queries - queries, head 0", (rq - q)[0], tr)],
        checks,
    )
