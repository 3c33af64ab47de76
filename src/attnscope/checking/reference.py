"""The reference pipeline in float64, and the same pipeline with one known mistake.

Each :class:`Mutation` swaps exactly one step of the pipeline for a known mistake (keys
from ``W_query``, softmax over the queries, no causal mask, ...); the catalogue of them is
:mod:`.mistakes`, one home per code. The checker runs the mutations on the same input and
weights as the user's code: a mutation whose output equals the user's output names the
mistake and its stage, even where the user's stages are fused and never exist as tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..stages import Kind, Stage
from .alibi import Alibi
from .qknorm import ContextNorm, QKNorm
from .relbias import LearnedBias
from .rotary import Rope

__all__ = [
    "Spec",
    "Weights",
    "Mutation",
    "pipeline",
    "project",
    "split",
    "merge",
    "causal_hide",
    "window_hide",
    "band_hide",
    "window_mask",
]

T = torch.Tensor


@dataclass(frozen=True)
class Spec:
    """What the reference computes: the kind and the sizes.

    ``num_heads`` is 1 for single-head kinds; ``has_out`` says whether an output
    projection follows the merged heads. ``kv_heads`` (grouped heads: keys and values have
    fewer, query head h reading kv head ``h // (num_heads // kv_heads)``) and ``rope`` (the
    rotary embedding read from the layer, :class:`.rotary.Rope`) are what modern layers add.
    """

    kind: Kind
    d_in: int
    d_out: int
    num_heads: int = 1
    has_out: bool = False
    kv_heads: int | None = None
    rope: Rope | None = None
    #: causal kinds: each query sees its last ``window`` keys; other kinds: the keys within
    #: ``(window - 1) // 2`` positions on either side (a bidirectional local window)
    window: int | None = None
    #: the window the layer's mask shows, where it differs from ``window`` (the declared one)
    window_seen: int | None = None
    qk_norm: QKNorm | None = None
    #: the position bias added to the scores: ALiBi's, or a learned one as the layer adds it
    position_bias: Alibi | LearnedBias | None = None
    #: a scale the layer's configuration declares instead of 1/sqrt(d_k) (Gemma's
    #: ``query_pre_attn_scalar``), and in words where it comes from
    declared_scale: float | None = None
    scale_source: str = ""
    #: logit soft-capping the layer declares (Gemma 2): ``cap * tanh(logits / cap)`` on the
    #: scaled (and biased) scores, before the mask
    softcap: float | None = None
    #: a norm over the merged heads before the output projection (a sub-LayerNorm)
    out_norm: ContextNorm | None = None
    #: what the mask of a batch packed into one sequence hides where it lets queries see
    #: other sequences' keys, ``(batch * tokens, batch * tokens)`` (see
    #: :attr:`.layer.Structure.packed_leak`)
    packed_leak: T | None = field(default=None, compare=False)

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
    def kv(self) -> int:
        """Key/value heads: ``kv_heads``, or one per query head."""
        return self.kv_heads or self.num_heads

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.kv

    @property
    def scale(self) -> float:
        """The factor scores are multiplied by: ``1/sqrt(d_k)`` (1 for simplified), or the
        one the layer declares."""
        if self.simplified:
            return 1.0
        if self.declared_scale is not None:
            return self.declared_scale
        return 1.0 / math.sqrt(self.head_dim)


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
def window_hide(n: int, window: int) -> T:
    """``(n, n)`` bool: the future, and keys ``window`` or more behind the query."""
    ones = torch.ones(n, n, dtype=torch.bool)
    return ones.triu(1) | ones.tril(-window)


@functools.lru_cache(maxsize=64)
def band_hide(n: int, window: int) -> T:
    """``(n, n)`` bool: keys more than ``(window - 1) // 2`` positions from the query, on
    either side (a bidirectional local window of ``window`` keys, the query included)."""
    i = torch.arange(n)
    return (i[:, None] - i[None, :]).abs() > (window - 1) // 2


def window_mask(n: int, window: int, causal: bool) -> T:
    """What a sliding window hides: :func:`window_hide` (causal), :func:`band_hide`."""
    return window_hide(n, window) if causal else band_hide(n, window)


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
    values_as_keys: bool = False  # the weights times the keys the scores took, not the values
    merge: Callable[[T], T] | None = None
    skip_out: bool = False
    # modern layers: the rotation of queries and keys ((role, heads) -> rotated), the
    # values rotated too, and how key/value heads reach the query heads
    rotate: Callable[[str, T], T] | None = None
    rotate_values: bool = False
    norm: Callable[[str, T], T] | None = None  # (role, heads) -> normed, for the QK norm
    norm_after_rope: frozenset = frozenset()  # roles normed after the rotation
    bias: Callable[[int, int], T | None] | None = None  # (heads, tokens) -> position bias
    kv_from_queries: bool = False  # cross-attention: keys and values from the wrong input
    # cross-attention: only the keys ("k") or only the values ("v") from the wrong input
    from_queries: str = ""
    # cross-attention: (role, the role whose weights made it) for keys or values projected
    # from their own sequence with another role's weights (keys made with W_query)
    reweigh: tuple[tuple[str, str], ...] = ()
    expand_kv: Callable[[T, int], T] | None = None
    expand_keys: Callable[[T, int], T] | None = None  # keys alone (values by expand_kv)
    expand_values: Callable[[T, int], T] | None = None
    replace: dict[str, T] = field(default_factory=dict)  # stage name -> the user's tensor
    user_dim: int | None = None  # softmax over this axis of the user's own layout
    facts: dict = field(default_factory=dict)


NONE = Mutation("none", Stage.OUTPUT, "the reference")


def project(x: T, spec: Spec, w: Weights | None, context: T | None = None) -> tuple[T, T, T]:
    """Queries, keys, values ``(B, T, d_out)``: computed once, shared by every mutation.

    ``context`` ``(B, S, d)``: cross-attention's other sequence, which keys and values read.
    """
    if spec.simplified:
        return x, x, x
    source = x if context is None else context
    return _lin(x, w.q, w.bq), _lin(source, w.k, w.bk), _lin(source, w.v, w.bv)


def pipeline(
    x: T,
    spec: Spec,
    w: Weights | None,
    mut: Mutation = NONE,
    proj: tuple[T, T, T] | None = None,
    batched: bool = True,
    nan_rows: float | str | None = None,
    context: T | None = None,
) -> dict[str, T]:
    """Every stage of the reference (or of one mutation) for ``x``.

    Args:
        x: ``(B, T, d_in)`` float64.
        spec: kind and sizes; ``w``: the bound weights (``None`` for simplified).
        proj: :func:`project` of ``x``, when already computed.
        batched: whether the user's code saw a batch axis (for ``Mutation.user_dim``).
        nan_rows: the weight given to rows whose keys are all masked (NaN in the math; fused
            kernels such as ``scaled_dot_product_attention`` on the CPU give 0), or
            ``"uniform"``: every key of the row alike (a mask filled with a finite minimum).
        context: cross-attention's other sequence ``(B, S, d)`` (see :func:`project`).

    Returns:
        stage name -> tensor. Per-head stages are ``(B, H, T, *)`` for multi-head kinds and
        ``(B, T, *)`` otherwise; ``output`` is ``(B, T, d)``.
    """
    sub = {  # stages the mutation takes from the user's own tensors
        name: (t.unsqueeze(1) if not spec.multihead and t.dim() == 3 and name != "output" else t)
        for name, t in mut.replace.items()
    }
    if proj is None:
        proj = project(x, spec, w, context)
    stages = _heads(x, spec, w, mut, proj, sub)
    stages.update(_weights(stages, spec, mut, sub, batched, nan_rows))
    stages.update(_output(stages, spec, w, mut, sub))
    return _for_kind(stages, spec)


def _heads(x: T, spec: Spec, w: Weights | None, mut: Mutation, proj, sub) -> dict[str, T]:
    """Queries, keys and values cut into heads: ``(B, H, T, hd)`` each."""
    q, k, v = proj if proj is not None else project(x, spec, w)
    if mut.kv_from_queries:  # cross-attention read its keys and values from the queries' input
        _, k, v = project(x, spec, w)
    elif mut.from_queries:  # only the keys, or only the values, from the queries' input
        _, k2, v2 = project(x, spec, w)
        k = k2 if "k" in mut.from_queries else k
        v = v2 if "v" in mut.from_queries else v
    if mut.qkv is not None:
        q, k, v = mut.qkv(q, k, v)
    if mut.swap_batch:  # (B, T, D) read as (T, B, D): each position attends across the batch
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    cut = mut.split or split
    whole = (
        spec.qk_norm is not None
        and spec.qk_norm.scope == "full"
        and mut.norm is None
        and mut.split is not None
    )
    if whole:
        # heads cut wrongly after a norm over the whole projection: the norm saw each
        # token's row before the cut. The normed rows ride along the batch through the
        # same cut (one call per role: a cut may count its calls)
        b = q.shape[0]
        qn, kn = spec.qk_norm.apply_whole("q", q), spec.qk_norm.apply_whole("k", k)
        q2, k2 = cut(torch.cat([q, qn]), spec.num_heads), cut(torch.cat([k, kn]), spec.kv)
        qh, kh, vh = q2[:b], k2[:b], cut(v, spec.kv)
        cut_normed = {"q": q2[b:], "k": k2[b:]}
    else:
        qh, kh, vh = cut(q, spec.num_heads), cut(k, spec.kv), cut(v, spec.kv)
    if mut.rotate_values and spec.rope is not None:
        vh = spec.rope.rotate(vh)
    qh, kh, vh = sub.get("queries", qh), sub.get("keys", kh), sub.get("values", vh)
    out = {"queries": qh, "keys": kh, "values": vh}
    norm = None
    if spec.qk_norm is not None:
        norm = mut.norm or spec.qk_norm.apply
    if whole:

        def norm(role, t, base=spec.qk_norm):
            if ("queries" if role == "q" else "keys") in sub or role in mut.norm_after_rope:
                return base.apply(role, t)
            return cut_normed[role]

    turn = None
    if spec.rope is not None:
        turn = mut.rotate or (lambda role, t: spec.rope.rotate(t))
    for role, name, t in (("q", "queries", qh), ("k", "keys", kh)):
        late = role in mut.norm_after_rope
        if norm is not None and not late:
            t = out[f"normed_{name}"] = sub.get(f"normed_{name}", norm(role, t))
        if turn is not None:
            t = out[f"rotated_{name}"] = sub.get(f"rotated_{name}", turn(role, t))
        if norm is not None and late:  # the mistake: normed after the rotation
            t = out[f"normed_{name}"] = norm(role, t)
            if turn is not None:
                out[f"rotated_{name}"] = t
    return out


def expand_kv(t: T, group: int) -> T:
    """``(B, K, T, D) -> (B, K * group, T, D)``: kv head k serves query heads k*group.."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _weights(st: dict[str, T], spec: Spec, mut: Mutation, sub, batched, nan_rows) -> dict:
    """Scores, scaled scores, masked scores (causal kinds) and weights: ``(B, H, T, T)``."""
    qh = st.get("rotated_queries", st.get("normed_queries", st["queries"]))
    kh = st.get("rotated_keys", st.get("normed_keys", st["keys"]))
    kh = (mut.expand_keys or mut.expand_kv or expand_kv)(kh, spec.group)
    if mut.flatten_batch:  # the batch folded into the tokens: every sequence sees all others
        qh, kh = (_fold_batch(t) for t in (qh, kh))
    scores = sub.get("scores", mut.scores(qh, kh) if mut.scores else qh @ kh.transpose(-2, -1))
    factor = spec.scale if mut.scale is None else mut.scale
    scaled = scores * factor
    scaled = logits = sub.get("scaled_scores", scaled)
    biased = None
    if spec.position_bias is not None:
        n = scores.shape[-1]
        bias = (mut.bias or spec.position_bias.bias)(scores.shape[1], n)
        if bias is None:
            biased = scaled
        elif spec.position_bias.before_scale:  # Falcon: added to the raw scores, then scaled
            biased = (scores + bias.to(scores)) * factor
        else:
            biased = scaled + bias.to(scores)
        logits = biased = sub.get("biased_scores", biased)
    if spec.softcap is not None:
        logits = spec.softcap * torch.tanh(logits / spec.softcap)
    masked = None
    if spec.causal:
        if mut.mask:
            hide = mut.mask
        elif spec.window is not None:
            hide = lambda s: s.masked_fill(window_hide(s.shape[-1], spec.window), -torch.inf)  # noqa: E731
        else:
            hide = lambda s: s.masked_fill(causal_hide(s.shape[-1]), -torch.inf)  # noqa: E731
        logits = masked = sub.get("masked_scores", hide(logits))
    elif spec.window is not None:  # a bidirectional local window
        if mut.mask:
            hide = mut.mask
        else:
            hide = lambda s: s.masked_fill(band_hide(s.shape[-1], spec.window), -torch.inf)  # noqa: E731
        logits = masked = sub.get("masked_scores", hide(logits))
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
    if nan_rows == "uniform":  # hidden with a finite fill: the row's keys weighed alike
        hidden = weights.isnan().all(-1, keepdim=True)
        weights = torch.where(hidden, 1.0 / weights.shape[-1], weights)
    elif nan_rows is not None:
        weights = weights.nan_to_num(nan_rows)
    weights = sub.get("weights", weights)
    out = {"scores": scores, "scaled_scores": scaled, "masked_scores": masked, "weights": weights}
    if biased is not None:
        out["biased_scores"] = biased
    return out


def _output(st: dict[str, T], spec: Spec, w: Weights | None, mut: Mutation, sub) -> dict:
    """Context ``(B, H, T, hd)``, then the heads merged and projected: ``(B, T, d)``."""
    values = st["values"]
    if mut.values_as_keys:
        values = st.get("rotated_keys", st.get("normed_keys", st["keys"]))
    vh = (mut.expand_values or mut.expand_kv or expand_kv)(values, spec.group)
    vh = _fold_batch(vh) if mut.flatten_batch else vh
    weights = st["weights"]
    context = sub.get("context", mut.context(weights, vh) if mut.context else weights @ vh)
    if mut.flatten_batch:
        b, n = st["values"].shape[0], st["values"].shape[2]
        h = vh.shape[1]
        context = context.reshape(h, b, n, -1).transpose(0, 1)
    out = mut.merge(context) if mut.merge else merge(context)
    if spec.has_out and spec.out_norm is not None:
        out = spec.out_norm.apply(out)
    if spec.has_out and not mut.skip_out:
        out = _lin(out, w.o, w.bo)
    if mut.swap_batch:
        out = out.transpose(0, 1)
    return {"context": context, "output": out}


def _fold_batch(t: T) -> T:
    """``(B, H, T, X) -> (1, H, B*T, X)``: one long sequence of every sequence's tokens."""
    b, h, n, _ = t.shape
    return t.transpose(0, 1).reshape(1, h, b * n, -1)


def _for_kind(stages: dict[str, T], spec: Spec) -> dict[str, T]:
    """The stages the kind has, in pipeline order, single-head ones without a head axis."""
    order = [s.value for s in Stage if s.value in stages]
    stages = {name: stages[name] for name in order}
    if spec.simplified:
        for name in ("queries", "keys", "values", "scaled_scores"):
            stages.pop(name)
    if not spec.causal and spec.window is None:  # a bidirectional local window masks too
        stages.pop(Stage.MASKED_SCORES.value)
    if not spec.multihead:  # single head: drop the head axis
        stages = {
            k: (t.squeeze(1) if k != "output" and t.dim() == 4 else t) for k, t in stages.items()
        }
    return stages
