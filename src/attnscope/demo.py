"""The predict-then-check walk through the pipeline, as data (the CLI prints it).

:func:`run_demo` follows the seeds: pick a query, score it against every token (a loop and
``torch.dot`` agree), normalise the scores (by the sum, by a naive and a stable softmax),
then do the same with trainable weights (``SelfAttentionV1``), one query alone and then all
at once; causal masking and multi-head attention (without and with the causal mask) on
request. Every step says what to predict, records the predicted and actual shapes, the
tensors to show, and the checks that the seeds name. With the defaults it reproduces the
book's printed numbers.

:func:`make_trace` and :func:`trace_checks` serve ``attnscope trace`` and ``plot``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from . import functional as AF
from .errors import (
    AttnScopeError,
    check_embeddings,
    check_labels,
    check_seed,
    check_token_index,
)
from .examples import BOOK_TOKENS, TOY_TOKENS, book_embeddings, toy_scores
from .modules import CausalAttention, MultiHeadAttention, SelfAttentionV1, SelfAttentionV2
from .render.text import format_values
from .trace import ShapeCheck, Trace, trace

__all__ = [
    "BOOK_SEEDS",
    "DEMO_KINDS",
    "TRACE_KINDS",
    "Check",
    "DemoResult",
    "Shown",
    "Step",
    "default_token",
    "make_trace",
    "run_demo",
    "trace_checks",
]

#: The demo's parts, in the order ``"all"`` walks them (``None`` walks simplified then self).
#: As everywhere in attnscope, ``multihead`` has no causal mask and ``causal-multihead``
#: is the book's (causal) ``MultiHeadAttention``.
DEMO_KINDS = ("simplified", "self", "causal", "multihead", "causal-multihead")
#: What ``attnscope trace`` and ``plot`` can build.
TRACE_KINDS = ("simplified", "self", "causal", "multihead", "causal-multihead")
#: The seeds the book uses: V1, causal and multi-head with 123, V2 with 789.
BOOK_SEEDS = {"self": 123, "v2": 789, "causal": 123, "multihead": 123, "causal-multihead": 123}
#: Scores further than this below their row's largest get a softmax weight that may
#: underflow float32 to exactly 0 (exp(-80) is about 1.8e-35; exp(-104) is 0).
_EXP_RANGE = 80.0

# The book's printed numbers (4 decimals), shown beside ours when the demo runs the book's
# example; the per-token ones are for the book's query, token 1 ("journey").
_BOOK = {
    "simplified scores": [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    "simplified sum": [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656],
    "simplified softmax": [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    "simplified context": [0.4419, 0.6515, 0.5683],
    "toy sum": [0.125, 0.625, 0.25],
    "toy softmax": [0.0171, 0.9362, 0.0466],
    "query": [0.4306, 1.4551],
    "scores": [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440],
    "weights": [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820],
    "context": [0.3061, 0.8210],
    "first row": [0.2996, 0.8053],
    "v2 first row": [-0.0739, 0.0713],
    "causal first row": [-0.4519, 0.2216],
    "multihead first row": [0.3190, 0.4858],
}
_BOOK_TOKEN = 1


@dataclass(frozen=True)
class Check:
    """One named check with its outcome and a sentence saying what was compared."""

    name: str
    ok: bool
    detail: str

    def as_tuple(self) -> tuple[str, bool, str]:
        return (self.name, self.ok, self.detail)


@dataclass(frozen=True)
class Shown:
    """A tensor to print, with optional row and column labels."""

    name: str
    tensor: torch.Tensor
    rows: tuple[str, ...] | None = None
    cols: tuple[str, ...] | None = None


@dataclass
class Step:
    """One step of the walk: what to predict, then the shapes, values and checks."""

    part: str
    title: str
    predict: str
    shapes: list[ShapeCheck] = field(default_factory=list)
    shown: list[Shown] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.shapes) and all(c.ok for c in self.checks)


@dataclass
class DemoResult:
    """The whole walk: its steps in order and the trace of every part walked."""

    steps: list[Step]
    traces: dict[str, Trace]
    token: int
    book: bool

    @property
    def checks(self) -> list[Check]:
        """Every check, shape agreements included, in the order they ran."""
        out = []
        for step in self.steps:
            out += [
                Check(f"{s.name} shape", s.ok, f"predicted {s.predicted}, got {s.actual}")
                for s in step.shapes
            ]
            out += step.checks
        return out

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def main_trace(self) -> Trace:
        """The trace of the last part walked (the one an HTML report shows)."""
        return list(self.traces.values())[-1]


# --- small helpers -----------------------------------------------------------------------


@contextmanager
def _seeded(seed: int):
    """``torch.manual_seed(seed)`` inside, the caller's RNG state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _agree(
    name: str, a: torch.Tensor, b: torch.Tensor, what: str, atol: float | torch.Tensor = 1e-6
) -> Check:
    """``a`` equals ``b`` to ``rtol=1e-5`` and ``atol`` (a number, or one per entry)."""
    ok = a.shape == b.shape and bool(
        ((a.double() - b.double()).abs() <= atol + 1e-5 * b.double().abs()).all()
    )
    diff = f"max |difference| {_maxdiff(a, b):.1e}" if a.shape == b.shape else "shapes differ"
    return Check(name, ok, f"{what}: {diff}")


def _dot_rounding(rows: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """How far two ways of summing ``rows @ vector`` may differ by rounding alone.

    Summing ``n`` products in any order is within ``n * eps`` (to first order) times the
    sum of their absolute values of the exact sum, so two orders are within twice that.
    """
    eps = torch.finfo(rows.dtype).eps
    n = rows.shape[-1]
    return 2 * n * eps / (1 - n * eps) * (rows.abs() @ vector.abs()).double() + 1e-6


def _book(name: str, actual: torch.Tensor) -> Check:
    expected = torch.tensor(_BOOK[name], dtype=torch.float64)
    got = actual.detach().double().flatten()
    # The book prints 4 decimals: agree to the rounding.
    ok = got.shape == expected.shape and bool((got - expected).abs().max() <= 6e-5)
    detail = f"book {format_values(expected)}" + ("" if ok else f"; got {format_values(got)}")
    return Check(f"matches the book: {name}", ok, detail)


def _rows_are_distributions(
    weights: torch.Tensor, logits: torch.Tensor | None = None, causal: bool = False
) -> Check:
    """Weights positive (zero exactly on masked keys when causal) and each row sums to 1.

    ``logits`` are what the softmax was given: a weight whose logit is more than
    :data:`_EXP_RANGE` below its row's largest may underflow float32 to exactly 0, so it
    must only be >= 0. Without ``logits`` every weight must be positive.
    """
    w = weights.double()
    sums_ok = torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-5)
    if logits is None:
        representable = torch.ones_like(w, dtype=torch.bool)
    else:
        representable = logits > logits.max(-1, keepdim=True).values - _EXP_RANGE
    sign_ok = bool((w >= 0).all() and (w[representable] > 0).all())
    if causal:
        above = AF.causal_mask(w.shape[-1])
        sign_ok = sign_ok and bool((w[..., above] == 0).all())
        name = "weights are zero above the diagonal, positive elsewhere, and each row sums to 1"
    else:
        name = "weights are positive and each row sums to 1"
    worst = (w.sum(-1) - 1).abs().max().item()
    detail = f"min weight {w.min().item():.4f}; max |row sum - 1| {worst:.1e}"
    underflow = 0 if logits is None else int((~representable & torch.isfinite(logits)).sum())
    if underflow:
        detail += (
            f"; {underflow} scores more than {_EXP_RANGE:g} below their row's largest may "
            "get weight exactly 0 (exp underflows float32)"
        )
    return Check(name, sums_ok and sign_ok, detail)


def _logits(tr: Trace) -> torch.Tensor:
    """What the trace's softmax was given: masked, else scaled, else raw scores."""
    for name in ("masked_scores", "scaled_scores", "scores"):
        if name in tr:
            return tr[name]
    raise AssertionError("every trace has scores")


def _output_shape(out: torch.Tensor, tokens: int, d_out: int) -> Check:
    want = (*out.shape[:-2], tokens, d_out)
    return Check(
        "the output has one row per token and d_out columns",
        tuple(out.shape) == want,
        f"{tokens} tokens, d_out={d_out}: expected {want}, got {tuple(out.shape)}",
    )


def _walk_check(tr: Trace, token: int) -> Check:
    walk = tr.walk(token)
    return Check(
        "the single-token context vector equals its row of the batched output",
        walk.matches,
        f"token {token} ({walk.label!r}) alone: {format_values(walk.context)}; "
        f"batched row {token}: {format_values(walk.batched_context)}; "
        f"max |difference| {walk.max_abs_diff:.1e}",
    )


def _shapes(tr: Trace, names: Sequence[str]) -> list[ShapeCheck]:
    return [c for c in tr.shape_checks() if c.name in names]


def _show(name: str, t: torch.Tensor, tr: Trace, square: bool = False) -> Shown:
    """Show ``t`` with token labels on its rows (and columns, for a tokens x tokens matrix)."""
    if t.dim() < 2:
        cols = tr.labels if t.shape[-1] == tr.dims.tokens and square else None
        return Shown(name, t, None, cols)
    return Shown(name, t, tr.labels, tr.labels if square else None)


def default_token(
    tokens: int, token: int | None, *, name: str = "token", negative: bool = True
) -> int:
    """``token`` checked against ``tokens``; by default the seed's second token (1), or 0.

    Negative positions count from the end unless ``negative=False`` (the CLI's ``--token``).
    """
    if token is None:
        return 1 if tokens > 1 else 0
    return check_token_index(token, tokens, name=name, negative=negative)


# --- the parts of the walk ----------------------------------------------------------------


def _simplified(x: torch.Tensor, labels: tuple[str, ...], t: int, book: bool):
    """The weightless walk on ``x`` ``(T, d_in)`` for query ``t``: ``(steps, trace)``."""
    tr = trace("simplified", x, labels=labels)
    name = labels[t]
    query = x[t]
    loop, dot, vec = (
        AF.query_scores_loop(x, query),
        AF.query_scores_dot(x, query),
        AF.query_scores(x, query),
    )
    steps = []
    checks = [
        _agree(
            "the loop and torch.dot agree",
            loop,
            dot,
            "multiply-and-sum vs torch.dot",
            _dot_rounding(x, query),
        ),
        _agree(
            "the vectorised inputs @ query agrees",
            loop,
            vec,
            "loop vs inputs @ query",
            _dot_rounding(x, query),
        ),
    ]
    if book and t == _BOOK_TOKEN:
        checks.append(_book("simplified scores", dot))
    steps.append(
        Step(
            "simplified",
            f"One query against every token: {name!r} is the query",
            f"The query is token {t} (Python counts from 0). Predict: one score per token, "
            f"{len(labels)} numbers, largest where a token points the same way as the query.",
            [ShapeCheck("scores", (len(labels),), tuple(dot.shape), "one score per input token")],
            [Shown("query", query), Shown("scores", dot, None, labels)],
            checks,
        )
    )

    by_sum = AF.normalize_sum(dot)
    naive, stable = AF.softmax_naive(dot, dim=0), AF.softmax(dot, dim=0)
    largest = dot.abs().max().item()
    if largest <= _EXP_RANGE:
        agree = _agree(
            "the naive and the stable softmax agree on small scores",
            naive,
            stable,
            "exp(s)/sum(exp(s)) vs torch.softmax",
        )
    else:  # not a failure: exp(s) itself leaves float32's range; the next step shows it
        agree = Check(
            "the naive and the stable softmax agree on small scores",
            True,
            f"skipped: these scores are not small (largest |score| {largest:.4g} > "
            f"{_EXP_RANGE:g}, where exp(s) over- or underflows float32); the next step "
            "shows what the naive softmax does then",
        )
    checks = [agree, _rows_are_distributions(stable, dot)]
    if book and t == _BOOK_TOKEN:
        checks += [_book("simplified sum", by_sum), _book("simplified softmax", stable)]
    steps.append(
        Step(
            "simplified",
            "Scores into weights",
            "Predict: dividing by the sum keeps the scores' proportions; softmax makes every "
            "weight positive and leans harder on the largest score. Both sum to 1.",
            [
                ShapeCheck(
                    "weights", tuple(dot.shape), tuple(stable.shape), "same shape as the scores"
                )
            ],
            [Shown("divided by sum", by_sum, None, labels), Shown("softmax", stable, None, labels)],
            checks,
        )
    )

    big = dot + 1000.0  # exp(1000) is inf in float32 and float64: inf / inf is NaN
    naive_big, stable_big = AF.softmax_naive(big, dim=0), AF.softmax(big, dim=0)
    overflow = not bool(torch.isfinite(naive_big).all())
    finite = bool(torch.isfinite(stable_big).all())
    # dot + 1000 is rounded to float32, which moves each score by up to half a unit in the
    # last place of the largest: the weights may move by that much, and no more.
    rounding = torch.finfo(big.dtype).eps * big.abs().max().item()
    same = torch.allclose(stable_big, stable, atol=max(1e-5, 2 * rounding))
    steps.append(
        Step(
            "simplified",
            "Large scores: why the built-in softmax",
            "Add 1000 to every score. Predict: softmax only sees differences, so the weights "
            "should not change; but exp(1000) overflows, so the naive version breaks.",
            [],
            [Shown("naive", naive_big, None, labels), Shown("stable", stable_big, None, labels)],
            [
                Check(
                    "the naive softmax overflows on large scores, the stable one does not",
                    overflow and finite and same,
                    f"naive: {int((~torch.isfinite(naive_big)).sum())} of {naive_big.numel()} "
                    f"not finite; stable: finite={finite}, equals the small-score weights={same}",
                )
            ],
        )
    )

    toy = toy_scores()
    toy_sum, toy_soft = AF.normalize_sum(toy), AF.softmax(toy, dim=0)
    steps.append(
        Step(
            "simplified",
            "The seed's toy scores: 'sat' against cat, sat, mat = 1, 5, 2",
            "Predict: the sum gives 1/8, 5/8, 2/8; softmax gives 'sat' far more than 5/8.",
            [],
            [
                Shown("scores", toy, None, TOY_TOKENS),
                Shown("divided by sum", toy_sum, None, TOY_TOKENS),
                Shown("softmax", toy_soft, None, TOY_TOKENS),
            ],
            [
                _rows_are_distributions(torch.stack([toy_sum, toy_soft])),
                _book("toy sum", toy_sum),
                _book("toy softmax", toy_soft),
            ],
        )
    )

    checks = [
        _rows_are_distributions(tr["weights"], tr["scores"]),
        _output_shape(tr["context"], tr.dims.tokens, tr.dims.d_in),
        _walk_check(tr, t),
    ]
    if book and t == _BOOK_TOKEN:
        checks.append(_book("simplified context", tr.walk(t).context))
    steps.append(
        Step(
            "simplified",
            "Every query at once: scores = inputs @ inputs.T",
            "Predict: a tokens x tokens score matrix (row = query, column = key), weights of "
            "the same shape, and one context row per token with d_in columns; row "
            f"{t} must equal {name!r} computed alone.",
            _shapes(tr, ("scores", "weights", "context")),
            [_show("weights", tr["weights"], tr, square=True), _show("context", tr["context"], tr)],
            checks,
        )
    )
    return steps, tr


def _self(x, labels, t, book, seed):
    """SelfAttentionV1 (and V2) on ``x`` ``(T, d_in)``, d_out=2 as in the book."""
    d_in, d_out = x.shape[-1], 2
    with _seeded(BOOK_SEEDS["self"] if seed is None else seed):
        v1 = SelfAttentionV1(d_in, d_out)
    seed_text = "torch.manual_seed(" + str(BOOK_SEEDS["self"] if seed is None else seed) + ")"
    book_t = book and t == _BOOK_TOKEN
    steps = [
        Step(
            "self",
            "Weight parameters: W_query, W_key, W_value",
            f"{seed_text}; SelfAttentionV1(d_in={d_in}, d_out={d_out}). Predict: three "
            f"trainable matrices of shape d_in x d_out = ({d_in}, {d_out}), random until "
            "training settles them.",
            [
                ShapeCheck(n, (d_in, d_out), tuple(getattr(v1, n).shape), "d_in x d_out")
                for n in ("W_query", "W_key", "W_value")
            ],
            [Shown("W_query", v1.W_query.detach())],
            [],
        )
    ]
    before = {n: p.detach().clone() for n, p in v1.named_parameters()}
    tr = v1.trace(x, labels=labels)
    walk = tr.walk(t)
    name = labels[t]

    checks = []
    if book_t:
        checks.append(_book("query", walk.query))
    steps.append(
        Step(
            "self",
            f"Project the query: {name!r} @ W_query",
            "Predict: queries, keys and values have one row per token and d_out columns; the "
            f"query is token {t} alone times W_query: {d_out} numbers.",
            _shapes(tr, ("queries", "keys", "values")),
            [Shown("query", walk.query)],
            checks,
        )
    )

    keys = tr["keys"]
    own = torch.dot(walk.query, keys[t])
    checks = [
        _agree(
            f"the score of key {t} is query . keys[{t}]",
            own.reshape(1),
            walk.scores[t].reshape(1),
            f"torch.dot(query, keys[{t}]) vs entry {t} of query @ keys.T",
            _dot_rounding(keys[t : t + 1], walk.query),
        ),
        Check(  # the query is projected alone here, with the others there: up to rounding
            "the query's row of the full score matrix equals its scores",
            walk.scores_match,
            f"query @ keys.T vs row {t} of queries @ keys.T: max |difference| "
            f"{_maxdiff(walk.scores, tr['scores'][t]):.1e}",
        ),
    ]
    if book_t:
        checks.append(_book("scores", walk.scores))
    steps.append(
        Step(
            "self",
            "Scores of this query: query @ keys.T",
            f"Predict: one raw score per key ({len(labels)}); key {t} is keys[{t}], not "
            f"keys[{t + 1}].",
            [
                ShapeCheck(
                    "scores (one query)", (len(labels),), tuple(walk.scores.shape), "one per key"
                )
            ],
            [Shown("scores", walk.scores, None, labels)],
            checks,
        )
    )

    checks = [_rows_are_distributions(tr["weights"], _logits(tr))]
    if book_t:
        checks.append(_book("weights", walk.weights))
    steps.append(
        Step(
            "self",
            f"Scale by sqrt(d_k) = sqrt({d_out}), then softmax",
            "Predict: positive weights that sum to 1, one per key; the ordering of the scores "
            "is kept.",
            [
                ShapeCheck(
                    "weights (one query)", (len(labels),), tuple(walk.weights.shape), "one per key"
                )
            ],
            [Shown("weights", walk.weights, None, labels)],
            checks,
        )
    )

    checks = [] if not book_t else [_book("context", walk.context)]
    steps.append(
        Step(
            "self",
            "Context vector of this query: weights @ values",
            f"Predict: {d_out} numbers, a weighted mix of the value rows.",
            [
                ShapeCheck(
                    "context (one query)", (d_out,), tuple(walk.context.shape), "d_out numbers"
                )
            ],
            [Shown("context", walk.context)],
            checks,
        )
    )

    out = tr.result
    checks = [_output_shape(out, tr.dims.tokens, d_out), _walk_check(tr, t)]
    if book:
        checks.append(_book("first row", out[0]))
    steps.append(
        Step(
            "self",
            "Every token at once: SelfAttentionV1(inputs)",
            f"Predict: every stage's shape from its rule; the output has {len(labels)} rows "
            f"and {d_out} columns, and row {t} is the context vector just computed.",
            _shapes(tr, tuple(tr.stages)),
            [_show("weights", tr["weights"], tr, square=True), _show("output", out, tr)],
            checks,
        )
    )

    steps.append(_parameters_step(v1, before, x, labels, t))

    with _seeded(BOOK_SEEDS["v2"] if seed is None else seed):
        v2 = SelfAttentionV2(d_in, d_out)
    with torch.no_grad():
        out2 = v2(x)
        # In float64: float32 rounds x @ W.T and x @ W differently, and large scores
        # magnify that in the softmax; the claim is that the two compute the same thing.
        v2_64 = copy.deepcopy(v2).double()
        carried, out2_64 = SelfAttentionV1.from_v2(v2_64)(x.double()), v2_64(x.double())
    checks = [
        _agree(
            "V1 carrying V2's weights (transposed) gives the same output",
            carried,
            out2_64,
            "SelfAttentionV1.from_v2(v2)(x) vs v2(x), in float64",
        )
    ]
    if book:
        checks.append(_book("v2 first row", out2[0]))
    seed_v2 = BOOK_SEEDS["v2"] if seed is None else seed
    steps.append(
        Step(
            "self",
            "SelfAttentionV2: nn.Linear instead of nn.Parameter",
            f"torch.manual_seed({seed_v2}); SelfAttentionV2(d_in={d_in}, d_out={d_out}). "
            "Predict: the same shapes, other numbers (nn.Linear starts from other random "
            f"values and stores its weight transposed, ({d_out}, {d_in})).",
            [
                ShapeCheck("output", (len(labels), d_out), tuple(out2.shape), "one row per token"),
                ShapeCheck(
                    "W_query.weight", (d_out, d_in), tuple(v2.W_query.weight.shape), "d_out x d_in"
                ),
            ],
            [Shown("output", out2, labels)],
            checks,
        )
    )
    return steps, tr


def _parameters_step(module: nn.Module, before: dict, x, labels, t) -> Step:
    """The seed's distinction: weight parameters are read, attention weights are computed."""
    changed = [n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])]
    params = Check(
        "the forward pass reads the weight parameters and leaves them unchanged",
        not changed,
        "all parameters bit-for-bit equal after the forward pass"
        if not changed
        else f"changed: {', '.join(changed)}",
    )
    other = _other_input(module, x)
    w1 = module.trace(x, labels=labels).walk(t).weights
    w2 = module.trace(other, labels=labels).walk(t).weights
    shown = [Shown("weights(x)", w1, None, labels), Shown("weights(other)", w2, None, labels)]
    checks = [params]
    if x.shape[-2] > 1:  # one token always gets weight 1, whatever the input
        checks.append(
            Check(
                "the attention weights change with the input",
                not torch.allclose(w1, w2, atol=1e-6),
                f"token {t}'s weights for x and for another input: max |difference| "
                f"{_maxdiff(w1, w2):.4f}",
            )
        )
    return Step(
        "self",
        "Weight parameters vs attention weights",
        "Predict: forward only reads W_query, W_key, W_value (training changes them), while "
        "the attention weights are computed afresh for every input: another input (random "
        "tokens, scaled so that their scores stay small) gets other weights.",
        [],
        shown,
        checks,
    )


def _other_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Random tokens shaped like ``x`` whose scaled scores stay within [-1, 1] for ``module``.

    Scaling ``x`` itself would not do: when its weights are one-hot (large scores), they
    stay one-hot at 2x or 0.5x. Small scores keep these weights well away from one-hot.
    """
    other = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    largest = module.trace(other)["scaled_scores"].abs().max().item()
    return other / largest**0.5 if largest > 1 else other  # scores are quadratic in x


def _causal(x, labels, t, book, seed):
    """CausalAttention on ``x`` ``(T, d_in)``, context_length=T, then dropout on its own."""
    d_in, d_out, tokens = x.shape[-1], 2, x.shape[-2]
    s = BOOK_SEEDS["causal"] if seed is None else seed
    with _seeded(s):
        ca = CausalAttention(d_in, d_out, context_length=tokens, dropout=0.0)
    ca.eval()
    tr = ca.trace(x, labels=labels)
    masked = tr["masked_scores"]
    hide = AF.causal_mask(tokens)
    mask_ok = bool(torch.isneginf(masked[hide]).all() and torch.isfinite(masked[~hide]).all())
    steps = [
        Step(
            "causal",
            "Hide the future: masked_scores",
            f"torch.manual_seed({s}); CausalAttention(d_in={d_in}, d_out={d_out}, "
            f"context_length={tokens}, dropout=0.0). Predict: the scaled scores with -inf "
            "above the diagonal: token i may look at tokens 0..i only.",
            _shapes(tr, ("scores", "scaled_scores", "masked_scores")),
            [_show("masked_scores", masked, tr, square=True)],
            [
                Check(
                    "the masked scores are -inf exactly above the diagonal",
                    mask_ok,
                    f"{int(hide.sum())} future positions -inf, the other "
                    f"{int((~hide).sum())} finite",
                )
            ],
        )
    ]
    steps.append(
        Step(
            "causal",
            "Weights: softmax over the visible keys",
            "Predict: zeros above the diagonal, each row still sums to 1; the first token "
            "can only attend to itself (weight 1).",
            _shapes(tr, ("weights",)),
            [_show("weights", tr["weights"], tr, square=True)],
            [_rows_are_distributions(tr["weights"], masked, causal=True)],
        )
    )

    out = tr.result
    checks = [_output_shape(out, tokens, d_out), _walk_check(tr, t)]
    if tokens > 1:
        q = t if t < tokens - 1 else 0  # a query with future tokens to change
        changed = x.clone()
        changed[q + 1 :] += 1.0
        with torch.no_grad():
            out_changed = ca(changed)
        checks.append(
            _agree(
                f"changing the tokens after {q} leaves output rows 0..{q} unchanged",
                out_changed[: q + 1],
                out[: q + 1],
                f"tokens {q + 1}.. shifted by 1",
            )
        )
    if book:
        checks.append(_book("causal first row", out[0]))
    steps.append(
        Step(
            "causal",
            "Output: one context row per token",
            f"Predict: ({tokens}, {d_out}); row i depends on tokens 0..i only.",
            _shapes(tr, ("context",)),
            [_show("output", out, tr)],
            checks,
        )
    )

    p = 0.5
    with _seeded(s):
        drop = nn.Dropout(p)
        ones = torch.ones(tokens, tokens)
        dropped = drop(ones)
    kept = dropped[dropped != 0]
    structure = bool(((dropped == 0) | (dropped == 1 / (1 - p))).all())
    drop.eval()
    identity = torch.equal(drop(ones), ones)
    steps.append(
        Step(
            "causal",
            f"Dropout on the weights (training only), p={p}",
            f"torch.manual_seed({s}); nn.Dropout({p}) on a matrix of ones. Predict: about half "
            f"the entries become 0 and the rest become 1/(1-{p}) = {1 / (1 - p):g}, so the "
            "expected sum is unchanged; in eval mode nothing changes.",
            [
                ShapeCheck(
                    "dropped", (tokens, tokens), tuple(dropped.shape), "same shape as the input"
                )
            ],
            [Shown("dropout(ones)", dropped)],
            [
                Check(
                    "dropout zeroes entries and scales the kept ones by 1/(1-p) in training mode",
                    structure and kept.numel() > 0,
                    f"{int((dropped == 0).sum())} zeros, {kept.numel()} kept, all equal to "
                    f"{1 / (1 - p):g}: {structure}",
                ),
                Check(
                    "dropout is the identity in eval mode",
                    identity,
                    "nn.Dropout.eval()(ones) equals ones" if identity else "eval mode changed it",
                ),
            ],
        )
    )
    return steps, tr


def _multihead(x, labels, t, book, seed, causal=False):
    """MultiHeadAttention on ``x`` ``(T, d_in)``: d_out=2, 2 heads; ``causal`` is the book's."""
    d_in, d_out, heads, tokens = x.shape[-1], 2, 2, x.shape[-2]
    part = "causal-multihead" if causal else "multihead"
    s = BOOK_SEEDS[part] if seed is None else seed
    with _seeded(s):
        mha = MultiHeadAttention(d_in, d_out, tokens, 0.0, num_heads=heads, causal=causal)
    mha.eval()
    tr = mha.trace(x, labels=labels)
    head_dim = d_out // heads
    which = "causal as in the book" if causal else "no mask: every token sees every token"
    book = book and causal  # the book prints the causal one's numbers
    steps = [
        Step(
            part,
            "Split d_out into heads",
            f"torch.manual_seed({s}); MultiHeadAttention(d_in={d_in}, d_out={d_out}, "
            f"context_length={tokens}, dropout=0.0, num_heads={heads}"
            f"{'' if causal else ', causal=False'}), {which}. "
            f"Predict: {heads} heads of head_dim = {d_out} // {heads} = {head_dim}: queries, keys "
            f"and values become ({heads}, {tokens}, {head_dim}).",
            _shapes(tr, ("queries", "keys", "values")),
            [],
            [],
        )
    ]
    walk = tr.walk(t)
    mask_text = ", future keys masked" if causal else ""
    steps.append(
        Step(
            part,
            "Each head attends on its own",
            f"Predict: per head a tokens x tokens matrix: ({heads}, {tokens}, {tokens}), "
            f"each head's rows summing to 1, scaled by sqrt(head_dim){mask_text}.",
            _shapes(tr, ("scores", "scaled_scores", "masked_scores", "weights")),
            [
                Shown(
                    f"weights of token {t}, per head",
                    walk.weights,
                    tuple(f"head {h}" for h in range(heads)),
                    labels,
                )
            ],
            [_rows_are_distributions(tr["weights"], _logits(tr), causal=causal)],
        )
    )
    with torch.no_grad():
        fast = mha(x)  # use_fast_path: scaled_dot_product_attention
    checks = [
        _output_shape(tr.result, tokens, d_out),
        _walk_check(tr, t),
        _agree(
            "the fast path (scaled_dot_product_attention) equals the explicit stages",
            fast,
            tr.result,
            "fused vs explicit output",
            atol=1e-5,
        ),
    ]
    if book:
        checks.append(_book("multihead first row", tr.result[0]))
    steps.append(
        Step(
            part,
            "Merge the heads and project: out_proj",
            f"Predict: contexts ({heads}, {tokens}, {head_dim}) concatenate back to "
            f"({tokens}, {d_out}), then out_proj mixes the heads.",
            _shapes(tr, ("context", "output")),
            [_show("output", tr.result, tr)],
            checks,
        )
    )
    return steps, tr


def run_demo(
    kind: str | None = None,
    *,
    x: torch.Tensor | None = None,
    labels: Sequence[str] | None = None,
    token: int | None = None,
    seed: int | None = None,
) -> DemoResult:
    """Walk the pipeline, predict then check, and return every step.

    Args:
        kind: one of :data:`DEMO_KINDS` for one part (``"multihead"`` without the causal
            mask, ``"causal-multihead"`` the book's), ``"all"`` for all of them in that
            order, ``None`` for simplified then self (the seeds' walk).
        x: ``(tokens, d_in)`` embeddings; the book's six by default.
        labels: one per token (made text with ``str``); the book's words for the book's
            embeddings.
        token: the query position (default 1, the book's "journey", or 0 for one token);
            negative positions count from the end.
        seed: the seed for every module; by default the book's (123, and 789 for V2).

    Returns:
        a :class:`DemoResult`; ``.ok`` says whether every check passed.
    """
    if kind is None:
        parts: tuple[str, ...] = ("simplified", "self")
    elif kind == "all":
        parts = DEMO_KINDS
    elif kind in DEMO_KINDS:
        parts = (kind,)
    else:
        raise AttnScopeError(
            f"kind: expected one of {', '.join(DEMO_KINDS)} or 'all', got {kind!r}"
        )
    if seed is not None:
        check_seed(seed)
    book = x is None and seed is None
    if x is None:
        x = book_embeddings()
        labels = BOOK_TOKENS if labels is None else labels
    x = check_embeddings(x, name="inputs", ranks=(2,)).float()
    tokens = x.shape[0]
    labels = tuple(str(i) for i in range(tokens)) if labels is None else labels
    labels = check_labels(labels, tokens)
    t = default_token(tokens, token)

    steps: list[Step] = []
    traces: dict[str, Trace] = {}
    with torch.no_grad():
        for part in parts:
            if part == "simplified":
                new, tr = _simplified(x, labels, t, book)
            elif part == "self":
                new, tr = _self(x, labels, t, book, seed)
            elif part == "causal":
                new, tr = _causal(x, labels, t, book, seed)
            else:
                new, tr = _multihead(x, labels, t, book, seed, causal=part == "causal-multihead")
            steps += new
            traces[part] = tr
    return DemoResult(steps, traces, t, book)


# --- attnscope trace / plot -------------------------------------------------------------------


def make_trace(
    kind: str,
    x: torch.Tensor,
    *,
    labels: Sequence[str] | None = None,
    seed: int = 123,
    d_out: int = 2,
    heads: int = 2,
) -> Trace:
    """Build the reference module of ``kind`` with ``seed`` and trace it on ``x``.

    Args:
        kind: one of :data:`TRACE_KINDS`. ``self`` is ``SelfAttentionV1``; ``causal`` is
            ``CausalAttention``; ``multihead``/``causal-multihead`` are ``MultiHeadAttention``
            without/with the causal mask. Dropout is 0 and modules are in eval mode.
        x: ``(tokens, d_in)`` or ``(batch, tokens, d_in)``.
        d_out, heads: output features and heads (``heads`` for the multi-head kinds only).
    """
    if kind not in TRACE_KINDS:
        raise AttnScopeError(f"kind: expected one of {', '.join(TRACE_KINDS)}, got {kind!r}")
    check_seed(seed)
    x = check_embeddings(x, name="inputs")
    if kind == "simplified":
        return trace("simplified", x, labels=labels)
    d_in, tokens = x.shape[-1], x.shape[-2]
    with _seeded(seed):
        if kind == "self":
            module: nn.Module = SelfAttentionV1(d_in, d_out)
        elif kind == "causal":
            module = CausalAttention(d_in, d_out, context_length=tokens, dropout=0.0)
        else:
            module = MultiHeadAttention(
                d_in, d_out, tokens, 0.0, num_heads=heads, causal=kind == "causal-multihead"
            )
    module.eval()
    return module.trace(x, labels=labels)


def trace_checks(tr: Trace, token: int) -> list[Check]:
    """The checks ``attnscope trace`` reports: shapes, weights, and the single-query walk."""
    bad = [c for c in tr.shape_checks() if not c.ok]
    checks = [
        Check(
            "every stage has its predicted shape",
            not bad,
            f"{len(tr.stages)} stages"
            if not bad
            else f"differs: {', '.join(str(c.stage) for c in bad)}",
        ),
        _rows_are_distributions(tr["weights"], _logits(tr), causal="masked_scores" in tr),
        _walk_check(tr, token),
    ]
    return checks
