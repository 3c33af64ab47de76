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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from . import functional as AF
from .errors import AttnScopeError, check_embeddings, check_token_index, describe
from .stages import Dims, Stage, stages_for_kind

__all__ = ["Trace", "QueryWalk", "ShapeCheck", "trace"]


@dataclass(frozen=True)
class ShapeCheck:
    """A stage's predicted shape beside its actual shape."""

    stage: Stage
    predicted: tuple[int, ...]
    actual: tuple[int, ...]
    rule: str

    @property
    def ok(self) -> bool:
        return self.predicted == self.actual


@dataclass
class QueryWalk:
    """The seed's single-query computation for one token, beside the batched row.

    Tensors have a leading head axis ``(H, ...)`` for multi-head traces.

    Attributes:
        token: the query position; ``label`` its token text.
        query: ``(d_k,)`` the query vector, projected from the token alone.
        scores, scaled_scores, masked_scores, weights: ``(T,)`` this query against every key
            (``scaled_scores``/``masked_scores`` are ``None`` where the kind has none).
        context: ``(d_v,)`` computed from this query alone.
        batched_context: the same row taken from the batched computation.
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

    @property
    def max_abs_diff(self) -> float:
        return (self.context - self.batched_context).abs().max().item()

    @property
    def matches(self) -> bool:
        """Whether the single-query context equals its row of the batched computation."""
        return torch.allclose(self.context, self.batched_context, rtol=1e-5, atol=1e-6)


@dataclass
class Trace:
    """Every stage of one forward pass, in pipeline order.

    Index by stage name (``trace["weights"]``) or :class:`Stage`. Shapes follow the
    input: ``(T, ...)`` unbatched, ``(B, T, ...)`` batched, ``(B, H, T, ...)`` per head.

    Attributes:
        kind: one of :data:`attnscope.stages.KINDS`.
        inputs: ``(T, d_in)`` or ``(B, T, d_in)`` what was traced.
        stages: stage name -> tensor, in pipeline order.
        dims: the sizes that predict every shape.
        labels: one label per token (defaults to ``"0"``, ``"1"``, ...).
        module: the traced module (``None`` for simplified attention).
    """

    kind: str
    inputs: torch.Tensor
    stages: dict[str, torch.Tensor]
    dims: Dims
    labels: tuple[str, ...]
    module: nn.Module | None = None
    _walks: dict[tuple[int, int], QueryWalk] = field(default_factory=dict, repr=False)

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
    def output(self) -> torch.Tensor:
        """What the module returned: ``output`` for multi-head, else ``context``."""
        return self.stages.get(Stage.OUTPUT.value, self.stages[Stage.CONTEXT.value])

    def predicted_shape(self, stage: str | Stage) -> tuple[int, ...]:
        """The shape the stage's rule predicts for this input."""
        return self.dims.shape_of(Stage(stage))

    def shape_checks(self) -> list[ShapeCheck]:
        """Predicted against actual shape for every stage, in order."""
        return [
            ShapeCheck(Stage(n), self.predicted_shape(n), tuple(t.shape), Stage(n).rule)
            for n, t in self.stages.items()
        ]

    def walk(self, token: int = 1, batch: int = 0) -> QueryWalk:
        """The single-query computation for ``token`` (default the seed's second token).

        The query is projected from that token alone, scored against every key with
        :func:`~attnscope.functional.query_scores`, normalised, and used to weight the values;
        the result is compared with row ``token`` of the batched context.
        """
        t = check_token_index(token, self.dims.tokens)
        if self.dims.batch is None and batch != 0:
            raise AttnScopeError(f"batch: expected 0 for an unbatched trace, got {batch}")
        if self.dims.batch is not None:
            batch = check_token_index(batch, self.dims.batch, name="batch index")
        key = (t, batch)
        if key not in self._walks:
            self._walks[key] = _walk(self, t, batch)
        return self._walks[key]

    # Rendering lives in attnscope.render; these are thin doors to it.
    def plot(self, stage: str = "weights", path: str | None = None, **kwargs):
        """Heatmap of ``stage`` (scores, scaled_scores, masked_scores or weights)."""
        from .render.figures import heatmap

        return heatmap(self, stage=stage, path=path, **kwargs)

    def pipeline_figure(self, path: str | None = None, **kwargs):
        """The seed's pipeline diagram, drawn from this trace's real shapes and values."""
        from .render.figures import pipeline_figure

        return pipeline_figure(self, path=path, **kwargs)

    def to_html(self, path: str | None = None, *, overwrite: bool = False) -> str:
        """A self-contained HTML report of this trace; written to ``path`` (never over a
        file unless ``overwrite``) when given."""
        from .render.html import trace_html

        return trace_html(self, path=path, overwrite=overwrite)

    def _repr_html_(self) -> str:
        return self.to_html()

    def __str__(self) -> str:
        from .render.text import trace_text

        return trace_text(self, color=False)  # str() is plain text wherever it is printed


def _labels(labels: Sequence[str] | None, tokens: int) -> tuple[str, ...]:
    if labels is None:
        return tuple(str(i) for i in range(tokens))
    labels = tuple(str(label) for label in labels)
    if len(labels) != tokens:
        raise AttnScopeError(f"labels: expected {tokens} labels (one per token), got {len(labels)}")
    return labels


def trace(target: nn.Module | str, x: torch.Tensor, labels: Sequence[str] | None = None) -> Trace:
    """Run ``target`` on ``x`` through its explicit path and record every stage.

    Args:
        target: an attnscope module (:class:`SelfAttentionV1`, ``V2``, :class:`CausalAttention`,
            :class:`MultiHeadAttention`) or the string ``"simplified"`` for weightless attention.
        x: ``(T, d_in)`` or ``(B, T, d_in)`` embeddings.
        labels: one label per token, for reports and pictures.
    """
    from .modules import _Traceable

    record: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if isinstance(target, str):
            if target != "simplified":
                raise AttnScopeError(
                    f"target: expected an attnscope module or 'simplified', got {target!r}"
                )
            x = check_embeddings(x, name="inputs")
            AF.simplified_attention(x, record=record)
            kind, d_out, heads, module = "simplified", x.shape[-1], None, None
        elif isinstance(target, _Traceable):
            x = target._check(x)
            target._pipeline(x, record)
            kind, d_out, heads, module = target.kind, target.d_out, target.num_heads, target
        else:
            raise AttnScopeError(
                "target: expected an attnscope module or 'simplified', got "
                f"{describe(target)}; to trace or check another implementation use "
                "attnscope.check"
            )
    dims = Dims(
        tokens=x.shape[-2],
        d_in=x.shape[-1],
        d_out=d_out,
        batch=x.shape[0] if x.dim() == 3 else None,
        num_heads=heads,
    )
    order = [s.value for s in stages_for_kind(kind) if s.value in record]
    stages = {name: record[name] for name in order}
    return Trace(kind, x, stages, dims, _labels(labels, dims.tokens), module)


def _project_one(module: nn.Module, name: str, token: torch.Tensor) -> torch.Tensor:
    """Project a single ``(d_in,)`` token with the module's ``name`` weights: ``(d_out,)``."""
    w = getattr(module, name)
    return token @ w if isinstance(w, nn.Parameter) else w(token)


def _walk(tr: Trace, t: int, b: int) -> QueryWalk:
    x = tr.inputs if tr.inputs.dim() == 2 else tr.inputs[b]
    row = (lambda s: tr[s]) if tr.dims.batch is None else (lambda s: tr[s][b])
    heads = tr.dims.num_heads
    with torch.no_grad():
        if tr.module is None:  # simplified: the query is the raw token
            query, keys, values = x[t], x, x
        else:
            query = _project_one(tr.module, "W_query", x[t])
            keys, values = row("keys"), row("values")
            if heads is not None:
                query = query.view(heads, -1)  # (H, head_dim)
        if heads is None:
            scores = AF.query_scores(keys, query)
        else:
            scores = torch.stack([AF.query_scores(keys[h], query[h]) for h in range(heads)])
        scaled = masked = None
        logits = scores
        if "scaled_scores" in tr:
            scaled = logits = scores / keys.shape[-1] ** 0.5
        if "masked_scores" in tr:
            masked = logits = scaled.clone()
            masked[..., t + 1 :] = -torch.inf
        weights = torch.softmax(logits, dim=-1)
        context = weights.unsqueeze(-2) @ values
        context = context.squeeze(-2)
        batched = row("context")[..., t, :]
    return QueryWalk(t, tr.labels[t], query, scores, scaled, masked, weights, context, batched)
