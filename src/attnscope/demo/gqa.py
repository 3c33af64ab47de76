"""Grouped-query attention: query heads share key/value heads (``GroupedQueryAttention``).

The shapes (``num_heads`` query heads, ``num_kv_heads`` key/value heads), which query head
reads which key/value head (silence one and see exactly its group change), multi-query to
multi-head, a sliding window, ALiBi's slopes and biases, the fast path, and the seed's
single-query walk on every variant.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .. import functional as AF
from ..grouped import GroupedQueryAttention
from ..lesson import Check, Shown, Step
from ..trace import ShapeCheck, Trace, row_stages
from .checks import (
    agree,
    forward_stages,
    hidden_rule,
    matrix_note,
    maxdiff,
    query_positions,
    rows_of,
    seeded,
    shapes,
    show,
    trace_rows,
    walk_check,
)

PART = "gqa"
SEED = 123  # the book's seed, as in the other parts
D_OUT, HEADS, KV_HEADS = 16, 4, 2  # head_dim 4; query heads 0, 1 read kv head 0, 2, 3 kv head 1
WINDOW = 3  # Mistral's sliding window, small enough to show on six tokens
ALIBI_HEADS = 8
#: ALiBi's slopes for 8 heads, as published (Press et al., 2022): 1/2, 1/4, ..., 1/256.
ALIBI_SLOPES_8 = (1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256)


def _layer(x: torch.Tensor, seed: int, heads: int = HEADS, kv: int = KV_HEADS, **options):
    with seeded(seed):
        layer = GroupedQueryAttention(x.shape[-1], D_OUT, heads, kv, **options)
    return layer.eval()


def walk(
    x: torch.Tensor, labels: tuple[str, ...], t: int, is_book: bool, seed: int | None, rows=None
):
    """GroupedQueryAttention on ``x`` ``(T, d_in)``, 4 query heads, 2 kv heads:
    ``(steps, trace)``; ``rows``: row traces of those queries (a long input)."""
    s = SEED if seed is None else seed
    layer = _layer(x, s)
    tr = trace_rows(layer, x, labels, rows)
    windowed = _layer(x, s, window=WINDOW)
    alibi = _layer(x, s, heads=ALIBI_HEADS, alibi=True)
    variants = {
        f"{HEADS} heads, {KV_HEADS} kv heads": (layer, tr),
        f"window={WINDOW}": (windowed, trace_rows(windowed, x, labels, rows)),
        f"ALiBi, {ALIBI_HEADS} heads": (
            alibi,
            trace_rows(alibi, x, labels, rows),
        ),
    }
    steps = [
        _shapes(tr, layer, s),
        _sharing(tr, layer, x),
        _mqa_to_mha(x, labels, s, rows),
        _window(*variants[f"window={WINDOW}"], x),
        _alibi(*variants[f"ALiBi, {ALIBI_HEADS} heads"], t),
        _fast_path(variants, x),
        _walks(variants, t),
    ]
    return steps, tr


def _shapes(tr: Trace, layer: GroupedQueryAttention, seed: int) -> Step:
    d, hd, group = tr.dims, layer.head_dim, layer.group
    kv_width = layer.num_kv_heads * hd
    return Step(
        PART,
        "Fewer key/value heads than query heads",
        f"torch.manual_seed({seed}); GroupedQueryAttention(d_in={d.d_in}, d_out={D_OUT}, "
        f"num_heads={HEADS}, num_kv_heads={KV_HEADS}) (RoPE on, causal, as in Llama). "
        f"Predict: head_dim = {D_OUT} // {HEADS} = {hd}; queries ({HEADS}, {d.tokens}, {hd}), "
        f"keys and values ({KV_HEADS}, {d.tokens}, {hd}): W_key and W_value give "
        f"{kv_width} features, 1/{group} of W_query's {HEADS * hd}; the scores still have one "
        f"matrix per query head ({HEADS}, {d.tokens}, {d.tokens}){matrix_note(tr)}.",
        [
            ShapeCheck(
                "W_query.weight",
                (HEADS * hd, d.d_in),
                tuple(layer.W_query.weight.shape),
                "num_heads * head_dim x d_in",
            ),
            ShapeCheck(
                "W_key.weight",
                (KV_HEADS * hd, d.d_in),
                tuple(layer.W_key.weight.shape),
                "num_kv_heads * head_dim x d_in",
            ),
            *shapes(tr, ("queries", "keys", "values", "scores", "context", "output")),
        ],
        [],
        [],
    )


def _sharing(tr: Trace, layer: GroupedQueryAttention, x: torch.Tensor) -> Step:
    heads, kv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    reads = " ".join(str(AF.kv_head_of(h, heads, kv)) for h in range(heads))
    # a long input compares the contexts of the rows its trace keeps, without the matrix
    context = rows_of(tr, tr["context"])
    checks, moved = [], []
    tol = 1e-5 * context.abs().max().item()  # rounding; the others do not move at all
    for k in range(kv):
        expected = [h for h in range(heads) if h // (heads // kv) == k]
        name = (
            f"zeroing kv head {k}'s values changes exactly the context of query heads "
            f"{', '.join(map(str, expected))}"
        )
        if not tr["values"][k].abs().max() > 0:
            moved.append([0.0] * heads)
            checks.append(Check(name, True, f"skipped: kv head {k}'s values are 0 already"))
            continue
        silent = copy.deepcopy(layer)
        with torch.no_grad():
            silent.W_value.weight[k * hd : (k + 1) * hd] = 0.0
        after = forward_stages(silent, x, tr.rows)["context"]
        moved.append([maxdiff(after[h], context[h]) for h in range(heads)])
        changed = [h for h in range(heads) if moved[-1][h] > tol]
        checks.append(
            Check(
                name,
                changed == expected,
                f"changed: query heads {', '.join(map(str, changed)) or 'none'}{_of_rows(tr)}",
            )
        )
    return Step(
        PART,
        "Which query head reads which kv head: h // (num_heads // num_kv_heads)",
        f"Predict: groups of {heads // kv} consecutive query heads share a kv head (Llama's "
        f"repeat_interleave, not repeat): query heads 0..{heads - 1} read kv heads {reads}. "
        "Zero one kv head's values (its rows of W_value): the context of its group, and "
        "only of its group, changes.",
        [],
        [
            Shown(
                "max |change| of each query head's context",
                torch.tensor(moved, dtype=torch.float64),
                tuple(f"kv {k} = 0" for k in range(kv)),
                tuple(f"head {h}" for h in range(heads)),
            )
        ],
        checks,
    )


def _of_rows(tr: Trace) -> str:
    """`` (rows 1, 9999)`` for a row trace: which rows a check compared; "" otherwise."""
    return "" if tr.rows is None else f" (rows {', '.join(map(str, tr.rows))})"


def _copied_to_groups(grouped: GroupedQueryAttention, x: torch.Tensor) -> GroupedQueryAttention:
    """A multi-head layer (``num_kv_heads = num_heads``) holding ``grouped``'s weights, each
    kv head's rows of W_key and W_value copied to every query head of its group."""
    heads, hd, d_in = grouped.num_heads, grouped.head_dim, grouped.d_in
    mha = GroupedQueryAttention(d_in, grouped.d_out, heads, heads).eval()
    with torch.no_grad():
        mha.W_query.weight.copy_(grouped.W_query.weight)
        mha.out_proj.weight.copy_(grouped.out_proj.weight)
        for name in ("W_key", "W_value"):
            w = getattr(grouped, name).weight.view(grouped.num_kv_heads, hd, d_in)
            getattr(mha, name).weight.copy_(
                w.repeat_interleave(grouped.group, dim=0).reshape(heads * hd, d_in)
            )
    return mha


def _mqa_to_mha(x: torch.Tensor, labels: tuple[str, ...], seed: int, rows=None) -> Step:
    """``rows``: a long input, whose outputs are compared on those rows."""
    tokens, divisors = x.shape[-2], [k for k in range(1, HEADS + 1) if HEADS % k == 0]
    shape_checks, checks, cache = [], [], []
    what = "" if rows is None else f" (rows {', '.join(map(str, rows))})"
    for kv in divisors:
        layer = _layer(x, seed, kv=kv)
        tr = forward_stages(layer, x, rows)
        hd = layer.head_dim
        readers = HEADS // kv
        rule = f"{kv} kv head{'s' if kv > 1 else ''}, each read by {readers} query "
        rule += "heads" if readers > 1 else "head"
        shape_checks.append(
            ShapeCheck(f"keys, num_kv_heads={kv}", (kv, tokens, hd), tuple(tr["keys"].shape), rule)
        )
        cache.append(2 * kv * hd)
        if kv < HEADS:
            # an identity of the maths, held in float64: at large input scales the softmax
            # saturates and float32 rounding of the two matmuls' different blockings would
            # move whole weights
            x64 = x.double()
            copied = forward_stages(_copied_to_groups(layer, x).double(), x64, rows)["output"]
            out = forward_stages(copy.deepcopy(layer).double(), x64, rows)["output"]
            checks.append(
                agree(
                    f"num_kv_heads={kv} equals multi-head attention with each kv head copied "
                    "to its group",
                    out,
                    copied,
                    f"grouped vs num_kv_heads={HEADS} with W_key, W_value rows repeated{what}",
                    atol=1e-9 * out.abs().max().item() + 1e-12,
                )
            )
    sizes = ", ".join(f"{n} for {k}" for n, k in zip(cache, divisors, strict=True))
    return Step(
        PART,
        f"From multi-query (num_kv_heads=1) to multi-head (num_kv_heads={HEADS})",
        f"Predict: with one kv head every query head reads the same keys (multi-query, "
        f"PaLM, Falcon); with {HEADS} each reads its own (multi-head). In between, a grouped "
        "layer computes exactly what multi-head attention computes once each kv head is "
        "copied to its group; what it saves is the cache: 2 * num_kv_heads * head_dim "
        f"numbers per token ({sizes} kv heads).",
        shape_checks,
        [],
        checks,
    )


def _window(layer: GroupedQueryAttention, tr: Trace, x: torch.Tensor) -> Step:
    tokens, w = tr.dims.tokens, layer.window
    masked = tr["masked_scores"]
    visible = torch.isfinite(masked)  # (H, T, T), or a long input's (H, rows, T)
    # key j is one of the last w up to query i: from positions, for the rows the trace keeps
    rule = ~hidden_rule(tr, w)
    counts = visible[0].sum(-1)
    expected = torch.tensor([min(q + 1, w) for q in query_positions(tr).tolist()])
    hidden_weights = tr["weights"][~rule.expand_as(tr["weights"])]
    checks = [
        Check(
            f"query i sees min(i + 1, {w}) keys, in every head",
            bool((visible.sum(-1) == expected).all()),
            f"visible keys per query{_of_rows(tr)}: {' '.join(map(str, counts.tolist()))}; "
            f"expected {' '.join(map(str, expected.tolist()))}",
        ),
        Check(
            f"the visible keys of query i are i - {w - 1} .. i",
            bool((visible == rule).all()),
            f"{int((visible != rule).sum())} cells differ from the rule",
        ),
        Check(
            "the weights outside the window are exactly 0",
            bool((hidden_weights == 0).all()),
            f"{hidden_weights.numel()} hidden cells, largest weight there "
            f"{hidden_weights.abs().max().item() if hidden_weights.numel() else 0.0:.1e}",
        ),
    ]
    name = f"changing token 0 leaves rows {w}.. of the output unchanged (outside their window)"
    if tokens > w:
        changed = x.clone()
        changed[0] += 1.0
        if tr.rows is None:
            with torch.no_grad():
                after, before = layer.trace(changed).result, tr.result
            first, far = 0, slice(w, None)
        else:  # a long input: rows 0, w and the last, of both inputs, without the matrix
            probe = sorted({0, w, tokens - 1})
            after = row_stages(layer, changed, probe)["output"]
            before = row_stages(layer, x, probe)["output"]
            first, far = 0, slice(1, None)
            name = name.replace(f"rows {w}..", f"rows {', '.join(map(str, probe[1:]))}")
        checks.append(agree(name, after[far], before[far], "token 0 shifted by 1", atol=0.0))
        checks.append(
            Check(
                "... and changes row 0, which sees it",
                maxdiff(after[first], before[first]) > 0,
                f"row 0: max |difference| {maxdiff(after[first], before[first]):.1e}",
            )
        )
    else:
        fit = "one token fits" if tokens == 1 else f"all {tokens} tokens fit"
        checks.append(Check(name, True, f"skipped: {fit} in the window"))
    return Step(
        PART,
        f"A sliding window: window={w} (Mistral)",
        f"GroupedQueryAttention(..., window={w}). Predict: besides the future, every key "
        f"{w} or more tokens back is hidden (-inf): query i sees keys i - {w - 1} .. i, "
        f"min(i + 1, {w}) of them, and nothing before reaches it{matrix_note(tr)}.",
        shapes(tr, ("masked_scores",)),
        [
            show("masked_scores, head 0", masked[0], tr, square=True),
        ],
        checks,
    )


def _alibi(layer: GroupedQueryAttention, tr: Trace, t: int) -> Step:
    heads, tokens = layer.num_heads, tr.dims.tokens
    slopes = layer.alibi_slopes.double()
    bias = tr["biased_scores"].double() - tr["scaled_scores"].double()  # (H, T or rows, T)
    i = query_positions(tr).double()[:, None]
    j = torch.arange(tokens, dtype=torch.float64)[None, :]
    expected = -slopes[:, None, None] * (i - j).abs()
    ratios = slopes[1:] / slopes[:-1]
    size = tr["scaled_scores"].double().abs() + expected.abs()
    checks = [
        agree(
            f"the slopes of {heads} heads are ALiBi's published 1/2, 1/4, ..., 1/256",
            slopes,
            torch.tensor(ALIBI_SLOPES_8, dtype=torch.float64),
            "alibi_slopes vs the paper's",
            atol=0.0,
        ),
        agree(
            f"they are a geometric sequence: each is the one before times 2**(-8/{heads})",
            ratios,
            torch.full_like(ratios, 2.0 ** (-8.0 / heads)),
            "ratios of successive slopes",
            atol=1e-12,
        ),
        agree(
            "biased_scores - scaled_scores is -slope * |query - key|",
            bias,
            expected,
            "the trace's bias vs the rule, every head",
            atol=1e-6 * size,
        ),
    ]
    back = bias[..., 1:] - bias[..., :-1]  # key j+1 minus key j
    earlier = (j[:, 1:] <= i).expand_as(back)  # both keys at or before the query
    name = "in every row the bias rises toward the query: near keys are favoured"
    if tokens > 1:
        checks.append(
            Check(
                name,
                bool((back[earlier] > 0).all()),
                f"smallest step toward the query {back[earlier].min().item():.4f}",
            )
        )
    else:
        checks.append(Check(name, True, "skipped: one token, no distance"))
    return Step(
        PART,
        f"ALiBi: a linear bias per head instead of a rotation ({heads} heads)",
        f"GroupedQueryAttention(..., num_heads={heads}, num_kv_heads={layer.num_kv_heads}, "
        "alibi=True): no RoPE. Predict: head h adds -slope_h * distance to its scaled "
        "scores (biased_scores), with slopes 2**(-8/H), 2**(-16/H), ...: head 0 prefers near "
        f"keys most, the last head sees almost evenly{matrix_note(tr)}.",
        [
            ShapeCheck("alibi_slopes", (heads,), tuple(layer.alibi_slopes.shape), "one per head"),
            *shapes(tr, ("scaled_scores", "biased_scores", "masked_scores")),
        ],
        [
            Shown("slopes", slopes, None, tuple(f"head {h}" for h in range(heads))),
            Shown(
                f"bias of token {t} ({tr.labels[t]!r}) against every key",
                bias[:, tr.row_index(t)],
                tuple(f"head {h}" for h in range(heads)),
                tr.labels,
            ),
        ],
        checks,
    )


def _fused_rows(layer: GroupedQueryAttention, x: torch.Tensor, rows) -> torch.Tensor:
    """The fast path's fused call for the query ``rows`` only: the layer's queries, keys
    and values, ``scaled_dot_product_attention`` on those queries with their rows of the
    additive mask (-inf outside the causal window, ALiBi's bias) built from positions, then
    ``out_proj``: ``(len(rows), d_out)``, without a (T, T) mask."""
    with torch.no_grad():
        q, k, v = layer._queries_keys_values(x.unsqueeze(0), None, 0, None)
        q = q[..., list(rows), :]
        k, v = AF.repeat_kv(k, layer.group), AF.repeat_kv(v, layer.group)
        back = torch.tensor(rows)[:, None] - torch.arange(x.shape[-2])[None, :]
        hide = back < 0
        if layer.window is not None:
            hide = hide | (back >= layer.window)
        mask = torch.zeros(hide.shape, dtype=q.dtype).masked_fill(hide, -torch.inf)
        if layer.alibi:
            slopes = layer.alibi_slopes.double()[:, None, None]
            mask = mask + (-slopes * back.abs().double()).to(q.dtype)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = ctx.transpose(1, 2).reshape(len(rows), layer.num_heads * layer.head_dim)
        return layer.out_proj(out)


def _fast_path(variants: dict, x: torch.Tensor) -> Step:
    checks = []
    for what, (layer, tr) in variants.items():
        plain = layer.window is None and not layer.alibi  # the fused call needs no mask
        if tr.rows is None or plain:
            with torch.no_grad():
                fast = layer(x)  # use_fast_path: scaled_dot_product_attention
            explicit, detail = tr.result, "fused vs explicit output"
        else:  # a long input: the mask is (T, T) or (H, T, T); the chosen rows of it only
            fast, explicit = _fused_rows(layer, x, tr.rows), rows_of(tr, tr.result)
            detail = (
                f"fused on rows {', '.join(map(str, tr.rows))} (their mask rows from "
                "positions) vs those rows of the explicit output"
            )
        checks.append(
            agree(
                f"the fast path equals the explicit stages ({what})",
                fast,
                explicit,
                detail,
                atol=1e-5 * explicit.abs().max().item() + 1e-6,
            )
        )
    return Step(
        PART,
        "The fast path: scaled_dot_product_attention(..., enable_gqa=True)",
        "Predict: the fused call, given the kv heads unrepeated (enable_gqa, torch 2.5+) and "
        "the window and the bias as one additive mask, gives the output of the explicit "
        "stages (repeat_interleave, scores, mask, softmax, context), up to rounding.",
        [],
        [],
        checks,
    )


def _walks(variants: dict, t: int) -> Step:
    checks = []
    for what, (_, tr) in variants.items():
        c = walk_check(tr, t)
        checks.append(Check(f"{c.name} ({what})", c.ok, c.detail))
    _, tr = next(iter(variants.values()))
    heads = tr.dims.num_heads
    return Step(
        PART,
        f"One query alone: token {t} ({tr.labels[t]!r})",
        f"Predict: the query of token {t}, projected and rotated alone, scored against its "
        "kv head's keys in every query head (with the window's mask or ALiBi's bias row), "
        f"gives the same context as row {t} of the batch.",
        [],
        [
            Shown(
                "weights of this query, per head",
                tr.walk(t).weights,
                tuple(f"head {h}" for h in range(heads)),
                tr.labels,
            )
        ],
        checks,
    )
