"""The reference pipeline in float64, and the same pipeline with one known mistake.

Each :class:`Mutation` swaps exactly one step of the pipeline for a known mistake (keys
from ``W_query``, softmax over the queries, no causal mask, ...). The checker runs the
mutations on the same input and weights as the user's code: a mutation whose output equals
the user's output names the mistake and its stage, even where the user's stages are fused
and never exist as tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..stages import Kind, Stage

__all__ = ["Spec", "Weights", "Mutation", "pipeline", "mutations", "scores_kind_mutations"]

T = torch.Tensor


@dataclass(frozen=True)
class Spec:
    """What the reference computes: the kind and the sizes.

    ``num_heads`` is 1 for single-head kinds; ``has_out`` says whether an output
    projection follows the merged heads.
    """

    kind: Kind
    d_in: int
    d_out: int
    num_heads: int = 1
    has_out: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind.of(self.kind))

    @property
    def causal(self) -> bool:
        return self.kind.causal

    @property
    def multihead(self) -> bool:
        return self.kind.multihead

    @property
    def simplified(self) -> bool:
        return not self.kind.weighted

    @property
    def head_dim(self) -> int:
        return self.d_out // self.num_heads

    @property
    def scale(self) -> float:
        """The factor scores are multiplied by: ``1/sqrt(d_k)`` (1 for simplified)."""
        return 1.0 if self.simplified else 1.0 / math.sqrt(self.head_dim)


@dataclass
class Weights:
    """Bound projection weights, float64, in ``x @ W + b`` form.

    ``q``, ``k``, ``v``: ``(d_in, d_out)``; ``o``: ``(d_out, d_model)`` or ``None``.
    """

    q: T
    k: T
    v: T
    bq: T | None = None
    bk: T | None = None
    bv: T | None = None
    o: T | None = None
    bo: T | None = None
    source: str = ""


def _lin(x: T, w: T, b: T | None) -> T:
    return x @ w if b is None else x @ w + b


def split(t: T, heads: int) -> T:
    """``(B, T, D) -> (B, H, T, D/H)``."""
    b, n, d = t.shape
    return t.reshape(b, n, heads, d // heads).transpose(1, 2)


def merge(t: T) -> T:
    """``(B, H, T, hd) -> (B, T, H*hd)``."""
    b, h, n, hd = t.shape
    return t.transpose(1, 2).reshape(b, n, h * hd)


@functools.lru_cache(maxsize=64)
def causal_hide(n: int, diagonal: int = 1) -> T:
    """``(n, n)`` bool, True where key j is hidden from query i (``j - i >= diagonal``).

    Cached (every mutation asks for it); callers only read it.
    """
    return torch.ones(n, n, dtype=torch.bool).triu(diagonal)


@dataclass
class Mutation:
    """One known mistake: the step it replaces, its code, stage and a plain description."""

    code: str
    stage: Stage
    label: str
    qkv: Callable[[T, T, T], tuple[T, T, T]] | None = None
    split: Callable[[T, int], T] | None = None
    flatten_batch: bool = False
    swap_batch: bool = False  # batch and tokens exchanged: attention across the batch
    scores: Callable[[T, T], T] | None = None
    scale: float | None = None
    mask: Callable[[T], T] | None = None
    softmax: Callable[[T], T] | None = None
    after_softmax: Callable[[T], T] | None = None
    context: Callable[[T, T], T] | None = None
    merge: Callable[[T], T] | None = None
    skip_out: bool = False
    replace: dict[str, T] = field(default_factory=dict)  # stage name -> the user's tensor
    user_dim: int | None = None  # softmax over this axis of the user's own layout
    facts: dict = field(default_factory=dict)


NONE = Mutation("none", Stage.OUTPUT, "the reference")


def project(x: T, spec: Spec, w: Weights | None) -> tuple[T, T, T]:
    """Queries, keys, values ``(B, T, d_out)``: computed once, shared by every mutation."""
    if spec.simplified:
        return x, x, x
    return _lin(x, w.q, w.bq), _lin(x, w.k, w.bk), _lin(x, w.v, w.bv)


def pipeline(
    x: T,
    spec: Spec,
    w: Weights | None,
    mut: Mutation = NONE,
    proj: tuple[T, T, T] | None = None,
    batched: bool = True,
    nan_rows: float | None = None,
) -> dict[str, T]:
    """Every stage of the reference (or of one mutation) for ``x``.

    Args:
        x: ``(B, T, d_in)`` float64.
        spec: kind and sizes; ``w``: the bound weights (``None`` for simplified).
        proj: :func:`project` of ``x``, when already computed.
        batched: whether the user's code saw a batch axis (for ``Mutation.user_dim``).
        nan_rows: the weight given to rows whose keys are all masked (NaN in the math; fused
            kernels such as ``scaled_dot_product_attention`` on the CPU give 0).

    Returns:
        stage name -> tensor. Per-head stages are ``(B, H, T, *)`` for multi-head kinds and
        ``(B, T, *)`` otherwise; ``output`` is ``(B, T, d)``.
    """
    q, k, v = proj if proj is not None else project(x, spec, w)
    if mut.qkv is not None:
        q, k, v = mut.qkv(q, k, v)
    if mut.swap_batch:  # (B, T, D) read as (T, B, D): each position attends across the batch
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    heads = spec.num_heads
    cut = mut.split or split
    qh, kh, vh = cut(q, heads), cut(k, heads), cut(v, heads)
    sub = {
        name: (t.unsqueeze(1) if not spec.multihead and t.dim() == 3 and name != "output" else t)
        for name, t in mut.replace.items()
    }
    qh, kh, vh = sub.get("queries", qh), sub.get("keys", kh), sub.get("values", vh)
    b, h, n, _ = qh.shape
    if mut.flatten_batch:  # the batch folded into the tokens: every sequence sees all others
        qh, kh, vh = (t.transpose(0, 1).reshape(1, h, b * n, -1) for t in (qh, kh, vh))
    scores = mut.scores(qh, kh) if mut.scores else qh @ kh.transpose(-2, -1)
    scores = sub.get("scores", scores)
    scaled = scores * (spec.scale if mut.scale is None else mut.scale)
    scaled = sub.get("scaled_scores", scaled)
    logits = scaled
    masked = None
    if spec.causal:
        masked = (
            mut.mask(scaled)
            if mut.mask
            else scaled.masked_fill(causal_hide(scaled.shape[-1]), -torch.inf)
        )
        logits = masked = sub.get("masked_scores", masked)
    if mut.user_dim is not None:
        # the user's axis numbers count the user's layout: (B,) (H,) T_q, T_k
        layout = ([0] if batched else []) + ([1] if spec.multihead else []) + [2, 3]
        if not -len(layout) <= mut.user_dim < len(layout):
            raise ValueError("that axis does not exist in this layout")
        weights = torch.softmax(logits, dim=layout[mut.user_dim])
    else:
        weights = mut.softmax(logits) if mut.softmax else torch.softmax(logits, dim=-1)
    if mut.after_softmax is not None:
        weights = mut.after_softmax(weights)
    if nan_rows is not None:
        weights = weights.nan_to_num(nan_rows)
    weights = sub.get("weights", weights)
    context = mut.context(weights, vh) if mut.context else weights @ vh
    context = sub.get("context", context)
    if mut.flatten_batch:
        context = context.reshape(h, b, n, -1).transpose(0, 1)
    merged = mut.merge(context) if mut.merge else merge(context)
    out = merged
    if spec.has_out and not mut.skip_out:
        out = _lin(merged, w.o, w.bo)
    if mut.swap_batch:
        out = out.transpose(0, 1)
    stages = {
        Stage.QUERIES.value: qh,
        Stage.KEYS.value: kh,
        Stage.VALUES.value: vh,
        Stage.SCORES.value: scores,
        Stage.SCALED_SCORES.value: scaled,
        Stage.MASKED_SCORES.value: masked,
        Stage.WEIGHTS.value: weights,
        Stage.CONTEXT.value: context,
        Stage.OUTPUT.value: out,
    }
    if spec.simplified:
        for name in ("queries", "keys", "values", "scaled_scores"):
            stages.pop(name)
    if not spec.causal:
        stages.pop(Stage.MASKED_SCORES.value)
    if not spec.multihead:  # single head: drop the head axis
        stages = {
            k: (t.squeeze(1) if k != "output" and t.dim() == 4 else t) for k, t in stages.items()
        }
    return stages


# ----------------------------------------------------------------------------- mutations


def _named_scales(spec: Spec, tokens: int) -> list[tuple[float, str]]:
    dk, din, dout, h = spec.head_dim, spec.d_in, spec.d_out, spec.num_heads
    named = [
        (1.0 / dk, f"1/d_k = 1/{dk}"),
        (1.0 / math.sqrt(din), f"1/sqrt(d_in) = 1/sqrt({din})"),
        (1.0 / din, f"1/d_in = 1/{din}"),
        (math.sqrt(dk), f"sqrt(d_k) = sqrt({dk})"),
        (float(dk), f"d_k = {dk}"),
        (1.0 / math.sqrt(dout), f"1/sqrt(d_out) = 1/sqrt({dout})"),
        (1.0 / dout, f"1/d_out = 1/{dout}"),
        (1.0 / math.sqrt(tokens), f"1/sqrt(tokens) = 1/sqrt({tokens})"),
        (1.0 / tokens, f"1/tokens = 1/{tokens}"),
        (1.0 / math.sqrt(h), f"1/sqrt(num_heads) = 1/sqrt({h})"),
        (1.0 / math.sqrt(dk) ** 0.5, f"1/d_k**0.25 = 1/{dk}**0.25"),
        (1.0 / (dk * h), f"1/(d_k*num_heads) = 1/{dk * h}"),
        (1.0 / math.sqrt(dk * dk * h), f"1/(d_k*sqrt(num_heads)) = 1/({dk}*sqrt({h}))"),
        (0.5, "1/2"),
        (2.0, "2"),
    ]
    # equal sizes give equal factors: name them together ("1/sqrt(d_in) = 1/sqrt(d_out) = ...")
    merged: dict[float, tuple[float, list[str], str]] = {}
    for value, text in named:
        if math.isclose(value, spec.scale, rel_tol=1e-9) or value == 1.0:
            continue
        name, _, number = text.partition(" = ")
        key = round(value, 9)
        if key in merged:
            if number:  # a bare number ("2") adds nothing to a named factor
                merged[key][1].append(name)
        else:
            merged[key] = (value, [name], number)
    return [
        (value, " = ".join([*names, number]) if number else names[0])
        for value, names, number in merged.values()
    ]


def describe_scale(value: float, spec: Spec, tokens: int) -> str:
    """Name a scale factor when it is a familiar expression of the sizes."""
    if math.isclose(value, 1.0, rel_tol=1e-3):
        return "1 (no scaling)"
    for v, text in _named_scales(spec, tokens):
        if math.isclose(v, value, rel_tol=1e-3):
            return text
    return f"{value:.6g}"


def _project_swaps(combined_qkv: bool) -> list[tuple[tuple[int, int, int], str]]:
    names = ("W_query", "W_key", "W_value")
    stages = ("queries", "keys", "values")
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
                wrong = [f"{stages[i]} from {names[s]}" for i, s in enumerate(src) if s != i]
                out.append((src, ", ".join(wrong)))
    return out


def _first_wrong_stage(src: tuple[int, int, int]) -> Stage:
    for i, s in enumerate(src):
        if s != i:
            return (Stage.QUERIES, Stage.KEYS, Stage.VALUES)[i]
    return Stage.QUERIES


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


def _finite_mask(fill: float) -> Callable[[T], T]:
    """The causal mask with a finite fill (-1e9): wrong-axis softmaxes then differ from -inf."""
    return lambda s: s.masked_fill(causal_hide(s.shape[-1]), fill)


def _shift_keys(q: T, k: T, shift: int) -> T:
    """Scores written one key off, the slot left over staying 0 (a loop over range(1, T))."""
    s = q @ k.mT
    out = torch.zeros_like(s)
    if shift > 0:
        out[..., :-shift] = s[..., shift:]
    else:
        out[..., -shift:] = s[..., :shift]
    return out


def _bias_mistakes(biases: tuple[T | None, T | None, T | None]) -> list[Mutation]:
    """A projection without its bias, every projection without one, or another's bias."""
    stages = (Stage.QUERIES, Stage.KEYS, Stage.VALUES)

    def shift(i: int, delta: T) -> Callable[[T, T, T], tuple[T, T, T]]:
        return lambda q, k, v: tuple(t + delta if j == i else t for j, t in enumerate((q, k, v)))

    out = []
    for i, bias in enumerate(biases):
        if bias is None:
            continue
        out.append(
            Mutation(
                "wrong_projection",
                stages[i],
                f"{stages[i]} projected without their bias",
                qkv=shift(i, -bias),
            )
        )
        for j, other in enumerate(biases):
            if j != i and other is not None and other.shape == bias.shape:
                out.append(
                    Mutation(
                        "wrong_projection",
                        stages[i],
                        f"{stages[i]} projected with the bias of the {stages[j]}",
                        qkv=shift(i, other - bias),
                    )
                )
    present = [b for b in biases if b is not None]
    if len(present) > 1:
        out.append(
            Mutation(
                "wrong_projection",
                next(st for st, b in zip(stages, biases, strict=True) if b is not None),
                "projections without their biases",
                qkv=lambda q, k, v: tuple(
                    t if b is None else t - b for t, b in zip((q, k, v), biases, strict=True)
                ),
            )
        )
    return out


def _l2(q: T, k: T) -> T:
    """Squared distances ``|q_i - k_j|^2`` without a (..., T, T, d) intermediate."""
    return (q * q).sum(-1, keepdim=True) + (k * k).sum(-1).unsqueeze(-2) - 2 * q @ k.mT


def mutations(
    spec: Spec,
    tokens: int,
    batch: int,
    *,
    combined_qkv: bool = False,
    biases: tuple[T | None, T | None, T | None] = (None, None, None),
) -> list[Mutation]:
    """Every known single mistake that applies to ``spec``, in pipeline order.

    ``biases`` are the query, key and value biases, for the mistake of leaving one out.
    """
    ms: list[Mutation] = []
    S, Q, K, V = Stage, Stage.QUERIES, Stage.KEYS, Stage.VALUES
    if not spec.simplified:
        for src, label in _project_swaps(combined_qkv):
            ms.append(
                Mutation(
                    "wrong_projection",
                    _first_wrong_stage(src),
                    label,
                    qkv=lambda q, k, v, s=src: tuple((q, k, v)[i] for i in s),
                )
            )
        ms += _bias_mistakes(biases)
    if spec.multihead and spec.num_heads > 1:
        inverses = {_split_tokens: _merge_tokens, _split_interleaved: _merge_interleaved}
        for bad, how in ((_split_tokens, "tokens"), (_split_interleaved, "interleaved features")):
            ms.append(
                Mutation("heads_split", Q, f"heads cut from {how} (all of q, k, v)", split=bad)
            )
            ms.append(  # the same wrong cut, undone consistently when the heads are merged
                Mutation(
                    "heads_split",
                    Q,
                    f"heads cut from {how} (all of q, k, v), merged back the same way",
                    split=bad,
                    merge=inverses[bad],
                )
            )
            for i, stage in enumerate((Q, K, V)):
                ms.append(
                    Mutation(
                        "heads_split",
                        stage,
                        f"heads of {stage} cut from {how}",
                        split=_only(i, bad),
                    )
                )
    ms.append(
        Mutation("scores_transposed", S.SCORES, "keys @ queries^T", scores=lambda q, k: k @ q.mT)
    )
    for shift in (1, -1):
        ms.append(
            Mutation(
                "wrong_key_index",
                S.SCORES,
                f"key index shifted by {shift}",
                scores=lambda q, k, s=shift: q @ k.roll(s, dims=-2).mT,
            )
        )
    ms.append(
        Mutation(
            "wrong_key_index", S.SCORES, "keys reversed", scores=lambda q, k: q @ k.flip(-2).mT
        )
    )
    not_dot = {
        "cosine similarity": lambda q, k: (
            (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).mT
        ),
        "negative squared distance": lambda q, k: -_l2(q, k),
        "negative distance": lambda q, k: -_l2(q, k).sqrt(),
        "squared distance": _l2,
        "sum of query and key": lambda q, k: q.sum(-1, keepdim=True) + k.sum(-1).unsqueeze(-2),
        "negative L1 distance": lambda q, k: -(q.unsqueeze(-2) - k.unsqueeze(-3)).abs().sum(-1),
        "query . query": lambda q, k: q @ q.mT,
    }
    for label, fn in not_dot.items():
        ms.append(Mutation("not_dot_product", S.SCORES, label, scores=fn))
    if batch > 1:
        ms.append(
            Mutation("batch_mixing", S.SCORES, "batch folded into the tokens", flatten_batch=True)
        )
        ms.append(
            Mutation(
                "batch_mixing",
                S.SCORES,
                "each query attends to the keys and values of the whole batch",
                scores=lambda q, k: (
                    q @ k.transpose(0, 1).reshape(1, k.shape[1], -1, k.shape[-1]).mT
                ),
                context=lambda w, v: w @ v.transpose(0, 1).reshape(1, v.shape[1], -1, v.shape[-1]),
            )
        )
        ms.append(
            Mutation(
                "batch_mixing",
                S.SCORES,
                "batch and tokens exchanged (a (batch, tokens, d) input read as (tokens, "
                "batch, d): batch_first=False?): each position attends across the batch",
                swap_batch=True,
            )
        )
        ms.append(
            Mutation(
                "batch_mixing",
                S.SCORES,
                "each query scored against the keys summed over the batch",
                scores=lambda q, k: q @ k.sum(0, keepdim=True).mT,
            )
        )
        for what in ("keys", "keys and values"):
            ms.append(
                Mutation(
                    "batch_mixing",
                    S.SCORES,
                    f"{what} taken from another sequence of the batch",
                    qkv=lambda q, k, v, w=what: (
                        q,
                        k.roll(1, dims=0),
                        v.roll(1, dims=0) if "values" in w else v,
                    ),
                )
            )
    if spec.simplified:  # the book's simplified attention has no scaling at all
        for value, text in _named_scales(spec, tokens):
            ms.append(
                Mutation(
                    "wrong_scale",
                    S.SCALED_SCORES,
                    f"scaled by {text} (simplified attention is not scaled)",
                    scale=value,
                    facts={"c": value, "name": text},
                )
            )
    else:
        ms.append(
            Mutation("missing_scale", S.SCALED_SCORES, "no scaling", scale=1.0, facts={"c": 1.0})
        )
        for value, text in _named_scales(spec, tokens):
            ms.append(
                Mutation(
                    "wrong_scale",
                    S.SCALED_SCORES,
                    f"scaled by {text}",
                    scale=value,
                    facts={"c": value, "name": text},
                )
            )
    if spec.causal:
        ms.append(Mutation("missing_mask", S.MASKED_SCORES, "no mask", mask=lambda s: s))
        for d, label in (
            (0, "the mask also hides each token itself (triu diagonal=0)"),
            (2, "the mask shows the next token (triu diagonal=2)"),
            (3, "the mask shows the next two tokens (triu diagonal=3)"),
        ):
            for fill in (-torch.inf, -1e9):
                ms.append(
                    Mutation(
                        "mask_diagonal",
                        S.MASKED_SCORES,
                        label,
                        mask=lambda s, d=d, f=fill: s.masked_fill(causal_hide(s.shape[-1], d), f),
                    )
                )
        for d, label in ((0, "the mask hides the past (tril)"), (-1, "the mask hides the past")):
            ms.append(
                Mutation(
                    "mask_diagonal",
                    S.MASKED_SCORES,
                    label + " and shows the future",
                    mask=lambda s, d=d: s.masked_fill(
                        torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).tril(d), -torch.inf
                    ),
                )
            )
        fills = [(0.0, "0"), (-1.0, "-1"), (1.0, "1"), (-10.0, "-10"), (-100.0, "-100")]
        fills += [(-v * spec.scale, f"{-v:g} before scaling") for v in (1.0, 10.0, 100.0)]
        for value, text in fills:
            ms.append(
                Mutation(
                    "mask_fill_value",
                    S.MASKED_SCORES,
                    f"masked scores filled with {text}",
                    mask=lambda s, v=value: s.masked_fill(causal_hide(s.shape[-1]), v),
                    facts={"fill": value, "name": text},
                )
            )
    axes = [(-2, "the queries (dim=-2)", None), (0, "dim=0", 0), (1, "dim=1", 1)]
    if spec.multihead:
        axes.append((2, "dim=2", 2))
    for dim, text, user_dim in axes:
        for fill in (None, -1e9) if spec.causal else (None,):
            ms.append(
                Mutation(
                    "softmax_wrong_dim",
                    S.WEIGHTS,
                    f"softmax over {text} instead of the keys (dim=-1)",
                    mask=None if fill is None else _finite_mask(fill),
                    softmax=lambda s, d=dim: torch.softmax(s, dim=d),
                    user_dim=user_dim,
                    facts={"dim": dim},
                )
            )
    ms.append(
        Mutation(
            "softmax_wrong_dim",
            S.WEIGHTS,
            "softmax over the whole score matrix at once instead of each query's row",
            softmax=lambda s: torch.softmax(s.flatten(-2), dim=-1).view_as(s),
        )
    )
    not_softmax = {
        "scores divided by their row sum": lambda s: s / s.sum(-1, keepdim=True),
        "sigmoid": torch.sigmoid,
        "no normalisation": lambda s: s,
        "exp without normalising": torch.exp,
        "log_softmax": lambda s: torch.log_softmax(s, dim=-1),
        "relu divided by the row sum": lambda s: s.relu() / s.relu().sum(-1, keepdim=True),
        "masked scores set to 0 and divided by the row sum": lambda s: (
            s.nan_to_num(neginf=0.0) / s.nan_to_num(neginf=0.0).sum(-1, keepdim=True)
        ),
    }
    for label, fn in not_softmax.items():
        ms.append(Mutation("not_softmax", S.WEIGHTS, label, softmax=fn))
    if spec.causal:
        # softmax over the unmasked scores, then the mask on the weights
        ms.append(
            Mutation(
                "mask_after_softmax",
                S.WEIGHTS,
                "weights zeroed above the diagonal after the softmax, rows not renormalised",
                mask=lambda s: s,
                after_softmax=lambda w: w.masked_fill(causal_hide(w.shape[-1]), 0.0),
            )
        )
        ms.append(
            Mutation(
                "mask_after_softmax",
                S.WEIGHTS,
                "weights set to -inf above the diagonal after the softmax",
                mask=lambda s: s,
                after_softmax=lambda w: w.masked_fill(causal_hide(w.shape[-1]), -torch.inf),
            )
        )
    ms.append(
        Mutation(
            "context_wrong_product",
            S.CONTEXT,
            "weights transposed: weights^T @ values",
            context=lambda w, v: w.mT @ v,
        )
    )
    ms.append(
        Mutation(
            "context_wrong_product",
            S.CONTEXT,
            "weights summed over keys times values",
            context=lambda w, v: w.sum(-1, keepdim=True) * v,
        )
    )
    if spec.multihead and spec.num_heads > 1:
        merges = {
            "heads merged without moving the head axis back (mixes tokens)": lambda c: c.reshape(
                c.shape[0], c.shape[2], -1
            ),
            "heads merged feature-interleaved": lambda c: c.permute(0, 2, 3, 1).reshape(
                c.shape[0], c.shape[2], -1
            ),
            "heads concatenated in reverse order": lambda c: merge(c.flip(1)),
            "heads averaged instead of concatenated": lambda c: c.mean(1),
            "heads summed instead of concatenated": lambda c: c.sum(1),
        }
        for label, fn in merges.items():
            ms.append(Mutation("heads_merge", S.OUTPUT, label, merge=fn))
    if spec.has_out:
        ms.append(
            Mutation("missing_out_proj", S.OUTPUT, "output projection not applied", skip_out=True)
        )
    return ms


def with_scale(m: Mutation, value: float, text: str) -> Mutation:
    """A wrong_scale mutation with a fitted factor."""
    return replace(m, scale=value, label=f"scaled by {text}", facts={"c": value, "name": text})


# ------------------------------------------------------------------- scores of one query


def scores_kind_mutations() -> list[tuple[str, Stage, str, Callable[[T, int], T]]]:
    """Mistakes for ``f(inputs, query_index) -> (T,)``: (code, stage, label, fn)."""
    # a query taken from another token is found directly (which token each call scored)
    out: list[tuple[str, Stage, str, Callable[[T, int], T]]] = []
    for shift in (1, -1):
        out.append(
            (
                "wrong_key_index",
                Stage.SCORES,
                f"score of key i written at position i{shift:+d}",
                lambda x, i, s=shift: (x @ x[i]).roll(s),
            )
        )
    out.append(("wrong_key_index", Stage.SCORES, "keys reversed", lambda x, i: (x @ x[i]).flip(0)))
    not_dot = {
        "cosine similarity": lambda x, i: (x / x.norm(dim=-1, keepdim=True)) @ (x[i] / x[i].norm()),
        "negative squared distance": lambda x, i: -((x - x[i]) ** 2).sum(-1),
        "negative distance": lambda x, i: -((x - x[i]) ** 2).sum(-1).sqrt(),
        "sum of query and key": lambda x, i: x.sum(-1) + x[i].sum(),
        "softmax of the scores": lambda x, i: torch.softmax(x @ x[i], dim=0),
    }
    for label, fn in not_dot.items():
        out.append(("not_dot_product", Stage.SCORES, label, fn))
    return out
