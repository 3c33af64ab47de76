"""Traces: every stage of one forward pass, by name, with the rule that predicts its shape.

>>> import torch, attnscope
>>> torch.manual_seed(123)  # doctest: +SKIP
>>> t = attnscope.trace(attnscope.SelfAttentionV1(3, 2), attnscope.book_embeddings())
>>> t["weights"].shape
torch.Size([6, 6])
>>> t.walk(1).matches   # the "second token" computed alone equals row 1 of the batch
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from . import functional as AF
from .display import RenderedFigures
from .errors import AttnScopeError, check_embeddings, check_labels, check_token_index, describe
from .stages import Dims, Stage

__all__ = [
    "QueryWalk",
    "RowRecord",
    "ShapeCheck",
    "StageMap",
    "Trace",
    "Traceable",
    "row_stages",
    "trace",
]


class Traceable(nn.Module):
    """What :func:`trace` can run: a module whose forward is one explicit pipeline.

    Subclasses (the modules in :mod:`attnscope.modules`) implement :meth:`_pipeline`, which
    computes the output and, given a ``record``, stores every stage in it by name; the
    forward pass runs it without one. Input checks live here, once, for every module.
    """

    kind: str = "self"
    d_in: int
    d_out: int
    context_length: int | None = None
    num_heads: int | None = None

    def _check(self, x: object) -> torch.Tensor:
        x = check_embeddings(x, d_in=self.d_in, max_tokens=self.context_length)
        # A float64 input into float32 weights fails deep inside matmul; say so up front.
        param = next(self.parameters(), None)
        if param is not None and x.dtype != param.dtype:
            dtype = str(param.dtype).removeprefix("torch.")
            raise AttnScopeError(
                f"x: expected {dtype} to match the module's weights, got {describe(x)}; "
                f"convert it with .to(torch.{dtype}) (or the module with .to(x.dtype))"
            )
        return x

    def _check_inputs(
        self, x: object, context: object = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` checked, and ``context`` (only cross-attention layers take one)."""
        if context is not None:
            raise AttnScopeError(
                f"context: expected None for a self-attention layer, got {describe(context)}"
            )
        return self._check(x), None

    def _pipeline(self, x: torch.Tensor, record: AF.Record | None) -> torch.Tensor:
        raise NotImplementedError

    def _values(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """The ``values`` stage alone, as :meth:`_pipeline` records it for a batched ``x``:
        what a row trace makes again when it is read instead of holding it (a module without
        this method has its values held)."""
        raise NotImplementedError

    def _attend(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        record: AF.Record | None,
        *,
        causal: bool = False,
        mask: torch.Tensor | None = None,
        dropout: nn.Module | None = None,
        window: int | None = None,
        slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The core every module's pipeline calls: :func:`~attnscope.functional.attend`
        (every stage, full matrices), or for a row trace (``record`` a :class:`RowRecord`)
        the chosen rows' matrix stages and the blocked core with every query's summary.

        ``slopes``: ALiBi's per-head slopes (the full path builds the ``(H, T, S)`` bias from
        them; the row path builds it per block). ``mask``: the book's buffer, cropped.
        """
        if isinstance(record, RowRecord):
            # a row trace runs in eval mode: no dropout; the mask is the causal one (or the
            # window), built from positions, never as a (T, T) buffer
            AF.attend_rows(
                queries,
                keys,
                record.rows,
                causal=causal,
                window=window,
                bias_slopes=slopes,
                record=record,
            )
            if not record.every_query:  # the chosen rows alone (row_stages)
                context = AF.blocked_attention(
                    queries,
                    keys,
                    values,
                    causal=causal,
                    window=window,
                    bias_slopes=slopes,
                    block=record.block,
                    rows=record.rows,
                )
                record[Stage.CONTEXT.value] = context
                return context
            core = {"causal": causal, "window": window, "bias_slopes": slopes, "scale": None}
            return record.run_core(queries, keys, values, core)
        bias = None
        if slopes is not None:
            t_q, t_k = queries.shape[-2], keys.shape[-2]
            bias = AF.alibi_bias(slopes, t_q, t_k).to(queries.dtype).to(queries.device)
        return AF.attend(
            queries,
            keys,
            values,
            causal=causal,
            mask=mask,
            dropout=dropout,
            record=record,
            bias=bias,
            window=window,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, d_in)`` or ``(B, T, d_in)`` -> ``(T, d_out)`` or ``(B, T, d_out)``."""
        return self._pipeline(self._check(x), None)

    @staticmethod
    def _output(out: torch.Tensor, record: AF.Record | None, unbatched: bool) -> torch.Tensor:
        """The merged, projected heads as the stage ``output``; an unbatched call's stages
        and output without the batch axis the pipeline added."""
        if record is not None:
            record[Stage.OUTPUT.value] = out
            if unbatched:
                for name, tensor in list(record.items()):
                    record[name] = tensor.squeeze(0)
        return out.squeeze(0) if unbatched else out

    def trace(
        self,
        x: torch.Tensor,
        labels: Sequence[str] | None = None,
        context: torch.Tensor | None = None,
        *,
        rows: Sequence[int] | None = None,
        k: int = 4,
        block: int = 512,
        summary: bool = True,
    ) -> Trace:
        """Run the explicit path and return every stage by name (see :class:`Trace`);
        with ``rows``, a row trace (see :func:`trace`)."""
        return trace(
            self, x, labels=labels, context=context, rows=rows, k=k, block=block, summary=summary
        )

    # What Trace.walk asks of a module: one query computed alone. The defaults are the
    # book's layers: a projection (split into heads), a causal row, no bias.

    def _walk_query(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """``(d_k,)`` or ``(H, head_dim)``: the query of one ``(d_in,)`` token alone."""
        w = self.W_query
        query = token @ w if isinstance(w, nn.Parameter) else w(token)
        return query if self.num_heads is None else query.view(self.num_heads, -1)

    def _walk_bias(self, position: int, keys: int) -> torch.Tensor | None:
        """The bias added to that query's scaled scores, ``(..., 1, keys)``, or None."""
        return None

    def _walk_hidden(self, position: int, keys: int) -> torch.Tensor | None:
        """``(1, keys)`` bool: the keys hidden from that query, or None (row ``position``
        of :func:`~attnscope.functional.causal_mask`, built alone: no ``(T, T)`` mask)."""
        if "causal" not in str(self.kind):
            return None
        return (torch.arange(keys) > position).unsqueeze(0)

    def _query_bound(self, token: torch.Tensor) -> tuple[torch.Tensor, float]:
        """A bound on the query's entries from ``|x| @ |W| (+ |bias|)``, and how many times
        rounding is amplified after the projection (1: nothing happens to it)."""
        w = self.W_query
        weight, bias = (w, None) if isinstance(w, nn.Parameter) else (w.weight.T, w.bias)
        projected = token.abs() @ weight.abs() + (0 if bias is None else bias.abs())
        return projected, 1.0


@dataclass(frozen=True)
class ShapeCheck:
    """A predicted shape, with the rule that predicts it, beside the actual shape.

    ``name`` is a stage name for a trace's own checks (see :attr:`stage`), or any label
    (``"W_query"``, ``"scores (one query)"``) where the demo checks other tensors.
    """

    name: str
    predicted: tuple[int, ...]
    actual: tuple[int, ...]
    rule: str

    @property
    def ok(self) -> bool:
        return self.predicted == self.actual

    @property
    def stage(self) -> Stage:
        return Stage(self.name)


@dataclass(repr=False)
class QueryWalk:
    """The seed's single-query computation for one token, beside the batched row.

    Tensors have a leading head axis ``(H, ...)`` for multi-head traces.

    Attributes:
        token: the query position; ``label`` its token text.
        query: ``(d_k,)`` the query vector, projected from the token alone.
        scores, scaled_scores, masked_scores, weights: ``(T,)`` this query against every key
            (``scaled_scores``/``masked_scores`` are ``None`` where the kind has none;
            ``biased_scores``, last, where the layer adds a position bias).
        context: ``(d_v,)`` computed from this query alone.
        batched_context: the same row taken from the batched computation.
        rounding: how far floating-point rounding alone may move ``context`` from
            ``batched_context`` (per head for multi-head): the two sum their products in
            different orders, and the softmax magnifies the scores' rounding.
        scores_match: whether this query's logits (what the softmax was given) equal row
            ``token`` of the batched ones, up to rounding.
    """

    token: int
    label: str
    query: torch.Tensor
    scores: torch.Tensor
    scaled_scores: torch.Tensor | None
    masked_scores: torch.Tensor | None
    weights: torch.Tensor
    context: torch.Tensor
    batched_context: torch.Tensor
    rounding: torch.Tensor | float = 0.0
    scores_match: bool = True
    biased_scores: torch.Tensor | None = None

    def __repr__(self) -> str:
        """One line: which query, the shapes, and whether it equals its batched row (the
        tensors themselves are attributes: ``walk.weights``, ``walk.context``, ...)."""
        shown = ", ".join(
            f"{name} {tuple(t.shape)}"
            for name in ("query", "scores", "weights", "context")
            if (t := getattr(self, name)) is not None
        )
        return (
            f"QueryWalk(token {self.token} {self.label!r}: {shown}; matches its batched row: "
            f"{self.matches}, largest difference {self.max_abs_diff:.1e})"
        )

    @property
    def max_abs_diff(self) -> float:
        return (self.context - self.batched_context).abs().max().item()

    @property
    def matches(self) -> bool:
        """Whether the single-query computation equals its row of the batched one: the
        logits up to rounding, and the context to ``rtol=1e-5, atol=1e-6`` beyond what
        rounding alone explains (:attr:`rounding`)."""
        diff = (self.context - self.batched_context).abs()
        allowed = 1e-6 + 1e-5 * self.batched_context.abs() + self.rounding
        return self.scores_match and bool((diff <= allowed).all())


class RowRecord(dict):
    """The record of a row trace: stages by name, and what the core is asked for (the
    chosen query ``rows``, ``k`` heaviest keys per summary, the ``block`` size); the core
    leaves every query's :class:`~attnscope.functional.AttentionSummary` in ``summary``."""

    def __init__(
        self,
        rows: tuple[int, ...],
        k: int = 4,
        block: int = 512,
        every_query: bool = True,
        summary: bool = True,
    ):
        super().__init__()
        self.rows, self.k, self.block = rows, k, block
        #: False: the context (and output) of the chosen rows only, no summary
        #: (:func:`row_stages`)
        self.every_query = every_query
        #: False: the context alone in the blocked pass, the summary left for later (the
        #: values are kept in ``core``, and :attr:`Trace.summary` computes it on first use)
        self.want_summary = summary
        self.summary: AF.AttentionSummary | None = None
        #: what a summary left for later needs besides ``core`` (values, k, block)
        self.deferred: dict | None = None
        #: what the scores were made of and how (queries, keys, causal, window, slopes,
        #: scale): a pooled picture of the whole matrix is computed again from them
        self.core: dict | None = None
        #: True: once every query's context is made, the values are let go (the trace makes
        #: them again when read, see :class:`StageMap`); set where the module can
        self.remake_values = False

    def simplified(self, x: torch.Tensor) -> None:
        """Weightless attention's row trace: the tokens are queries, keys and values, and
        the scores are not scaled."""
        AF.attend_rows(x, x, self.rows, scale=1.0, record=self)
        del self[Stage.SCALED_SCORES.value]
        core = {"causal": False, "window": None, "bias_slopes": None, "scale": 1.0}
        self.run_core(x, x, x, core)

    def run_core(self, queries, keys, values, core: dict) -> torch.Tensor:
        """Every query's context over blocks of keys (and its summary, unless left for
        later); ``core``: how the scores are made (causal, window, bias_slopes, scale)."""
        options = {"block": self.block, **core}
        if self.want_summary:
            context, self.summary = AF.attention_summary(queries, keys, values, k=self.k, **options)
        else:
            context = AF.blocked_attention(queries, keys, values, **options)
            self.deferred = {"k": self.k, "block": self.block}
        self[Stage.CONTEXT.value] = context
        self.core = {"queries": queries, "keys": keys, **core}
        if self.remake_values:
            # the largest stage no later one needs: at 65,536 tokens and d 768, 192 MiB the
            # output projection then runs without
            self.pop(Stage.VALUES.value, None)
        return context


class StageMap(Mapping[str, torch.Tensor]):
    """Stage name -> tensor, in pipeline order: a mapping whose entries are held, or, for a
    row trace's ``values``, made again on first read.

    A row trace of a long input holds every whole stage; the values are the one no later
    stage or picture needs, so it lets them go once every context is made (at 65,536 tokens
    and d 768, 192 MiB) and keeps the recipe: the module's value projection of the traced
    input, run again in eval mode, the same computation on the same numbers. If the
    module's parameters or the input were changed in place (or replaced) since, reading
    them raises instead of returning other values.
    """

    def __init__(
        self,
        held: dict[str, torch.Tensor],
        order: Sequence[str] | None = None,
        remade: dict[str, Callable[[], torch.Tensor]] | None = None,
    ):
        self._held, self._remade = dict(held), dict(remade or {})
        self._order = tuple(order) if order is not None else tuple(held)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._remade:
            self._held[name] = self._remade.pop(name)()
        return self._held[name]

    def __contains__(self, name: object) -> bool:
        return name in self._held or name in self._remade

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def is_held(self, name: str) -> bool:
        """Whether ``name`` is in memory now (False: made again on first read)."""
        return name in self._held

    def __repr__(self) -> str:
        shown = (n if self.is_held(n) else f"{n} (made when read)" for n in self._order)
        return f"StageMap({', '.join(shown)})"


def _remake_values(
    module: Traceable, x: torch.Tensor, context: torch.Tensor | None, unbatched: bool
) -> Callable[[], torch.Tensor]:
    """The recipe of a row trace's ``values``: the module's value projection of ``x`` (its
    ``context`` for cross-attention), refused if weights or inputs changed since."""
    params = list(module.parameters())
    versions = [p._version for p in params]
    inputs = [t for t in (x, context) if t is not None]
    input_versions = [t._version for t in inputs]

    def remake() -> torch.Tensor:
        now = list(module.parameters())
        same = len(now) == len(params) and all(a is b for a, b in zip(now, params, strict=True))
        if (
            not same
            or [p._version for p in now] != versions
            or [t._version for t in inputs] != input_versions
        ):
            raise AttnScopeError(
                "values: expected the module and input of this row trace unchanged (its "
                "values are made again from them when first read), got weights or inputs "
                "changed in place since; trace again"
            )
        modes = {m: m.training for m in module.modules()}
        with torch.no_grad(), _eval_mode(modes):
            batched = (x.unsqueeze(0), None if context is None else context.unsqueeze(0))
            values = module._values(*batched) if unbatched else module._values(x, context)
        return values.squeeze(0) if unbatched else values

    return remake


@dataclass
class Trace(RenderedFigures):
    """Every stage of one forward pass, in pipeline order.

    Index by stage name (``trace["weights"]``) or :class:`Stage`. Shapes follow the
    input: ``(T, ...)`` unbatched, ``(B, T, ...)`` batched, ``(B, H, T, ...)`` per head.

    Attributes:
        kind: one of :data:`attnscope.stages.KINDS`.
        inputs: ``(T, d_in)`` or ``(B, T, d_in)`` what was traced.
        stages: stage name -> tensor, in pipeline order (a :class:`StageMap`; a row
            trace's ``values`` are made again on first read, see there).
        dims: the sizes that predict every shape.
        labels: one label per token (defaults to ``"0"``, ``"1"``, ...).
        module: the traced module (``None`` for simplified attention).
        rows: a row trace's chosen query positions (its matrix stages keep those rows
            only, ``(..., len(rows), S)``, in this order); ``None`` for a full trace.
    """

    kind: str
    inputs: torch.Tensor
    stages: Mapping[str, torch.Tensor]
    dims: Dims
    labels: tuple[str, ...]
    module: nn.Module | None = None
    _walks: dict[tuple[int, int], QueryWalk] = field(default_factory=dict, repr=False)
    rows: tuple[int, ...] | None = None
    _summary: AF.AttentionSummary | None = field(default=None, repr=False)
    _core: dict | None = field(default=None, repr=False)
    _deferred: dict | None = field(default=None, repr=False)
    _pooled: dict = field(default_factory=dict, repr=False)

    @property
    def summary(self) -> AF.AttentionSummary:
        """Every query's summary (entropy, largest weight and key, top-k keys, weight on
        the first token, mean distance), ``(..., T)`` per field: a row trace computes it
        blockwise with the context; a full trace from its ``weights``."""
        if self._summary is None and self._deferred is not None:  # a row trace's, left for later
            core, more = dict(self._core), self._deferred
            values = self.stages[Stage.VALUES.value] if "values" in self else core["keys"]
            if self.dims.batch is None and values.dim() < core["keys"].dim():
                values = values.unsqueeze(0)  # the core ran on a batch of one
            _, summary = AF.attention_summary(
                core.pop("queries"),
                core.pop("keys"),
                values,
                k=more["k"],
                block=more["block"],
                **core,
            )
            self._summary = summary.reshaped(self.stages[Stage.CONTEXT.value].shape[:-1])
        elif self._summary is None:
            self._summary = AF.summarize_weights(self.stages[Stage.WEIGHTS.value])
        return self._summary

    def pooled(
        self, stage: str | Stage = "weights", *, pool: int, reduce: str = "max"
    ) -> AF.PooledMatrix:
        """A matrix stage pooled over ``pool x pool`` tiles of (query, key) pairs, every
        query included: from the matrix of a full trace, and for a row trace computed again
        block by block from the queries and keys it kept (never the whole matrix), every
        matrix stage of the trace in the one pass the first call makes, kept for the next.

        Returns a :class:`~attnscope.functional.PooledMatrix` with values ``(...,
        ceil(T / pool), ceil(S / pool))``.
        """
        name = Stage(stage).value if isinstance(stage, Stage) else stage
        if name not in self:
            have = ", ".join(s.value for s in AF.POOLABLE if s.value in self)
            raise AttnScopeError(f"stage: expected one of {have} for this trace, got {stage!r}")
        if self._core is not None:
            # every matrix stage of the trace in the one pass the first asks for (a report
            # draws them all); kept, picture-sized, for the next
            key = (pool, reduce)
            if key not in self._pooled:
                core = dict(self._core)
                names = [s.value for s in AF.POOLABLE if s.value in self]
                found = AF.pooled_matrices(
                    core.pop("queries"),
                    core.pop("keys"),
                    stages=names,
                    pool=pool,
                    reduce=reduce,
                    logsumexp=self.summary.logsumexp,
                    **core,
                )
                for stage_name, out in found.items():
                    # the leading shape of the trace's matrix stages (a batch of one
                    # squeezed away)
                    lead = self.stages[stage_name].shape[:-2]
                    out.values = out.values.reshape(*lead, *out.values.shape[-2:])
                self._pooled[key] = found
            return self._pooled[key][name]
        hidden = None
        if Stage.MASKED_SCORES.value in self and Stage(name).order >= Stage.MASKED_SCORES.order:
            masked = self.stages[Stage.MASKED_SCORES.value]
            hidden = torch.isneginf(masked).reshape(-1, *masked.shape[-2:]).all(0)
        return AF.pool_matrix(
            self.stages[name], pool=pool, reduce=reduce, stage=name, hidden=hidden
        )

    def row_index(self, token: int) -> int:
        """Where query ``token`` sits in the matrix stages: ``token`` itself in a full
        trace, its place among :attr:`rows` in a row trace (an error if not chosen)."""
        if self.rows is None:
            return token
        if token not in self.rows:
            raise AttnScopeError(
                f"token: expected one of the traced rows {list(self.rows)} (a row trace keeps "
                f"only those queries' scores and weights), got {token}"
            )
        return self.rows.index(token)

    def __getitem__(self, stage: str | Stage) -> torch.Tensor:
        name = Stage(stage).value if isinstance(stage, Stage) else stage
        if name not in self.stages:
            raise AttnScopeError(
                f"stage: expected one of {', '.join(self.stages)} for a {self.kind} trace, "
                f"got {name!r}"
            )
        return self.stages[name]

    def __contains__(self, stage: object) -> bool:
        return str(stage) in self.stages

    def __iter__(self) -> Iterator[str]:
        return iter(self.stages)

    @property
    def result(self) -> torch.Tensor:
        """What the module returned: the ``output`` stage for multi-head, else ``context``.

        (``trace["output"]`` is only there for multi-head traces; this is there for all.)
        """
        return self.stages.get(Stage.OUTPUT.value, self.stages[Stage.CONTEXT.value])

    def predicted_shape(self, stage: str | Stage) -> tuple[int, ...]:
        """The shape the stage's rule predicts for this input."""
        if not isinstance(stage, Stage):
            names = [s.value for s in Stage]
            if stage not in names:
                raise AttnScopeError(
                    f"stage: expected one of {', '.join(names)}, got {describe(stage)}"
                )
            stage = Stage(stage)
        return self.dims.shape_of(stage)

    def shape_checks(self) -> list[ShapeCheck]:
        """Predicted against actual shape for every stage, in order."""
        return [
            ShapeCheck(n, self.predicted_shape(n), tuple(t.shape), Stage(n).rule)
            for n, t in self.stages.items()
        ]

    def walk(self, token: int = 1, batch: int = 0) -> QueryWalk:
        """The single-query computation for ``token`` (default the seed's second token).

        The query is projected from that token alone, scored against every key with
        :func:`~attnscope.functional.query_scores`, normalised, and used to weight the values;
        the result is compared with row ``token`` of the batched context.
        """
        t = check_token_index(token, self.dims.tokens)
        self.row_index(t)
        if self.dims.batch is None and batch != 0:
            raise AttnScopeError(f"batch: expected 0 for an unbatched trace, got {batch}")
        if self.dims.batch is not None:
            batch = check_token_index(batch, self.dims.batch, name="batch index", noun="sequences")
        key = (t, batch)
        if key not in self._walks:
            self._walks[key] = _walk(self, t, batch)
        return self._walks[key]


def trace(
    target: nn.Module | str,
    x: torch.Tensor,
    labels: Sequence[str] | None = None,
    context: torch.Tensor | None = None,
    *,
    rows: Sequence[int] | None = None,
    k: int = 4,
    block: int = 512,
    summary: bool = True,
) -> Trace:
    """Run ``target`` on ``x`` through its explicit path and record every stage.

    Args:
        target: an attnscope module (:class:`SelfAttentionV1`, ``V2``, :class:`CausalAttention`,
            :class:`MultiHeadAttention`) or the string ``"simplified"`` for weightless attention.
        x: ``(T, d_in)`` or ``(B, T, d_in)`` embeddings.
        labels: one label per token, for reports and pictures (each made text with ``str``).
        context: ``(S, d_in)`` or ``(B, S, d_in)``: what a cross-attention layer attends to.
        rows: a row trace (modules only): the matrix stages (``scores`` .. ``weights``) keep
            only these query positions, ``(..., len(rows), S)``, computed without the full
            matrix; every other stage is whole, the context computed over blocks of
            ``block`` keys in linear memory, and :attr:`Trace.summary` holds every query's
            summary (``k`` heaviest keys) from the same pass. Negative positions count from
            the end.
        summary: with ``rows``, ``False`` computes the context alone (a lighter pass) and
            leaves every query's summary to the first use of :attr:`Trace.summary` (one more
            pass then): for a caller that may never read it.

    A module runs in eval mode while it is traced, so dropout is off and every recorded
    stage belongs to one computation (``weights`` is what ``context`` was made from); each
    submodule's train/eval mode is restored afterwards.
    """
    record: dict[str, torch.Tensor] = {}
    if rows is not None:
        if not isinstance(target, Traceable) and target != "simplified":
            raise AttnScopeError(
                "rows: expected an attnscope module (or 'simplified') to trace rows of, got "
                f"{describe(target)}"
            )
        tokens = check_embeddings(x).shape[-2]
        record = RowRecord(AF.check_rows(rows, tokens), k=k, block=block, summary=summary)
        remakes = isinstance(target, Traceable) and type(target)._values is not Traceable._values
        record.remake_values = remakes
    modes = {m: m.training for m in target.modules()} if isinstance(target, nn.Module) else {}
    with torch.no_grad(), _eval_mode(modes):
        if isinstance(target, str):
            if target != "simplified":
                raise AttnScopeError(
                    f"target: expected an attnscope module or 'simplified', got {target!r}"
                )
            x = check_embeddings(x, name="inputs")
            if isinstance(record, RowRecord):
                record.simplified(x)
            else:
                AF.simplified_attention(x, record=record)
            kind, d_out, heads, module = "simplified", x.shape[-1], None, None
        elif isinstance(target, Traceable):
            x, context = target._check_inputs(x, context)
            extra = {} if context is None else {"context": context}
            target._pipeline(x, record, **extra)
            kind, d_out, heads, module = target.kind, target.d_out, target.num_heads, target
        else:
            raise AttnScopeError(
                "target: expected an attnscope module or 'simplified', got "
                f"{describe(target)}; to trace or check another implementation use "
                "attnscope.check"
            )
    kv_heads = getattr(module, "num_kv_heads", None)
    dims = Dims(
        tokens=x.shape[-2],
        d_in=x.shape[-1],
        d_out=d_out,
        batch=x.shape[0] if x.dim() == 3 else None,
        num_heads=heads,
        kv_heads=None if kv_heads == heads else kv_heads,
        head_size=getattr(module, "head_dim", None) if heads else None,
        key_tokens=None if context is None else context.shape[-2],
        rows=None if rows is None else len(record.rows),
    )
    # The kind's stages, and what a modern layer adds (norms, rotations, a bias), in order.
    order = [s.value for s in Stage if s.value in record]
    remade = {}
    if isinstance(record, RowRecord) and record.remake_values and "values" not in record:
        remade = {"values": _remake_values(target, x, context, unbatched=x.dim() == 2)}
        order = [s.value for s in Stage if s.value in record or s.value in remade]
    stages = StageMap({name: record[name] for name in order if name in record}, order, remade)
    labels = tuple(str(i) for i in range(dims.tokens)) if labels is None else labels
    tr = Trace(kind, x, stages, dims, check_labels(labels, dims.tokens), module)
    if isinstance(record, RowRecord):
        tr.rows = record.rows
        # the summary's leading shape is the context's (a batch of one squeezed with it)
        if record.summary is not None:
            tr._summary = record.summary.reshaped(stages[Stage.CONTEXT.value].shape[:-1])
        tr._core, tr._deferred = record.core, record.deferred
    return tr


def row_stages(
    module: Traceable, x: torch.Tensor, rows: Sequence[int], **options
) -> dict[str, torch.Tensor]:
    """The stages of a module's forward pass for the chosen query ``rows`` only, in
    ``O(len(rows) * T)``: queries, keys and values whole, every matrix stage, the context
    and the output ``(..., len(rows), ...)`` of those rows (no summary, no other query).

    What a check compares when it needs a few rows of another forward pass (a changed
    input, a changed layer) and not a whole trace. ``options`` go to the module's pipeline
    (``offset=`` for a :class:`~attnscope.GroupedQueryAttention`). Runs in eval mode.
    """
    x, context = module._check_inputs(x, None)
    record = RowRecord(AF.check_rows(rows, x.shape[-2]), every_query=False)
    modes = {m: m.training for m in module.modules()}
    with torch.no_grad(), _eval_mode(modes):
        out = module._pipeline(x, record, **options)
    record.setdefault(Stage.OUTPUT.value, out)
    return dict(record)


@contextmanager
def _eval_mode(modes: dict[nn.Module, bool]):
    """Every module in ``modes`` in eval mode inside; its own mode restored after."""
    for module in modes:
        module.training = False
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def _walk(tr: Trace, t: int, b: int) -> QueryWalk:
    x = tr.inputs if tr.inputs.dim() == 2 else tr.inputs[b]
    row = (lambda s: tr[s]) if tr.dims.batch is None else (lambda s: tr[s][b])
    heads, module = tr.dims.num_heads, tr.module
    with torch.no_grad():
        if module is None:  # simplified: the query is the raw token
            query, keys, values = x[t], x, x
        else:
            query = module._walk_query(x[t], t)  # (d_k,) or (H, head_dim)
            # the keys the scores use: after any norm and rotation, one per query head
            last = next(s for s in ("rotated_keys", "normed_keys", "keys") if s in tr)
            keys, values = row(last), row("values")
            if tr.dims.kv_heads is not None:
                keys = AF.repeat_kv(keys, heads // tr.dims.kv_heads)
                values = AF.repeat_kv(values, heads // tr.dims.kv_heads)
        if heads is None:
            scores = AF.query_scores(keys, query)
        else:
            scores = torch.stack([AF.query_scores(keys[h], query[h]) for h in range(heads)])
        # One query is a (1, T) row of the score matrix: the batched stages' own functions.
        scaled = biased = masked = None
        logits = scores.unsqueeze(-2)
        n_keys = keys.shape[-2]
        if "scaled_scores" in tr:
            logits = AF.scale_scores(logits, keys.shape[-1])
            scaled = logits.squeeze(-2)
        if "biased_scores" in tr:
            logits = logits + module._walk_bias(t, n_keys).to(logits.dtype)
            biased = logits.squeeze(-2)
        if "masked_scores" in tr:
            logits = AF.apply_causal_mask(logits, module._walk_hidden(t, n_keys))
            masked = logits.squeeze(-2)
        weights = AF.softmax(logits, dim=-1)
        context = AF.context_vectors(weights, values).squeeze(-2)
        weights = weights.squeeze(-2)
        batched = row("context")[..., t, :]
        stage = next(
            s for s in ("masked_scores", "biased_scores", "scaled_scores", "scores") if s in tr
        )
        scores_ok, bound = _rounding(
            tr, x[t], query, keys, values, logits.squeeze(-2), row(stage)[..., tr.row_index(t), :]
        )
    return QueryWalk(
        t,
        tr.labels[t],
        query,
        scores,
        scaled,
        masked,
        weights,
        context,
        batched,
        bound,
        scores_ok,
        biased,
    )


def _rounding(
    tr: Trace,
    token: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    logits: torch.Tensor,
    batched_logits: torch.Tensor,
) -> tuple[bool, torch.Tensor]:
    """Whether the walk's logits equal the batch's up to rounding, and how far rounding
    alone may then move the context: ``(scores_ok, bound)``, ``bound`` ``(1,)`` or ``(H, 1)``.

    Summing ``n`` products in any order is within ``gamma(n) = n*eps / (1 - n*eps)`` times
    the sum of their absolute values of the exact sum; the query is projected (walk: alone,
    batch: with the others) and then scored, so the two logits may differ by that much
    twice over. A softmax whose inputs differ by at most ``delta`` gives weights within a
    factor ``exp(2 delta)`` of each other, so the contexts differ by at most
    ``expm1(2 delta) * max|value|`` (plus the rounding of the softmax and the weighted sum).
    ``delta`` is the difference actually seen: the softmax magnifies a logit's rounding by
    the logit's size, which a bound from the inputs alone would overstate by far.
    """
    eps = torch.finfo(query.dtype).eps

    def gamma(n: int) -> float:
        return n * eps / max(1 - n * eps, 1e-3)

    visible = torch.isfinite(batched_logits)
    if not torch.equal(visible, torch.isfinite(logits)):
        return False, torch.zeros(1)  # the walk hides other keys than the batch
    d_k = keys.shape[-1]
    q_abs, err = query.abs(), 2 * gamma(d_k)
    if tr.module is not None:  # projected twice: |x| @ |W| (+ |bias|) bounds the query
        projected, amplified = tr.module._query_bound(token)
        q_abs = projected.view(query.shape)
        err = err + 2 * amplified * gamma(token.shape[-1] + 1)
    size = (keys.abs() @ q_abs.unsqueeze(-1)).squeeze(-1)  # (T,) or (H, T)
    if "scaled_scores" in tr:
        size, err = size / d_k**0.5, err + 2 * eps
    zero = torch.zeros_like(logits)
    diff = torch.where(visible, (logits - batched_logits).abs(), zero)
    allowed = err * size + 1e-6
    if "biased_scores" in tr:  # a large bias (ALiBi far from the query) and a score, each
        # rounded to float32 after the sum: half a unit in the last place of the logit, twice
        allowed = allowed + 2 * eps * torch.where(visible, batched_logits.abs(), zero)
    scores_ok = bool((diff <= allowed).all())
    delta = diff.amax(-1, keepdim=True)  # (1,) or (H, 1)
    v_max = values.abs().amax((-2, -1)).reshape(delta.shape)
    return scores_ok, (torch.expm1(2 * delta) + gamma(4 * keys.shape[-2] + 8)) * v_max
