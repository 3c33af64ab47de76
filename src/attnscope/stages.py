"""The stage vocabulary: the names of every tensor in the attention pipeline, in order.

::

    x -W_query-> queries -.
    x -W_key---> keys ----+-> scores -> scaled_scores -> [masked_scores] -> weights
    x -W_value-> values --+--------------------------------------------------'
                          '-> context -> [output: heads merged, projected]

These names are a public contract: the trace, the checker, its JSON report, the HTML
report and the docs all use exactly these strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Stage", "Dims", "Kind", "KINDS", "MATRIX_STAGES", "stages_for_kind"]


@dataclass(frozen=True)
class Kind:
    """A kind of attention, as what its pipeline has: compare flags, not names.

    ``weighted``: trainable query/key/value projections (not ``scores``/``simplified``);
    ``one_query``: the scores of one query only (``scores``); ``cross``: keys and values
    from a second input.
    """

    name: str
    weighted: bool
    causal: bool = False
    multihead: bool = False
    one_query: bool = False
    cross: bool = False

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def of(value: str | Kind) -> Kind:
        """The kind named ``value`` (a kind passes through)."""
        if isinstance(value, Kind):
            return value
        if value not in _BY_NAME:
            from .errors import AttnScopeError

            raise AttnScopeError(f"kind: expected one of {', '.join(KINDS)}, got {value!r}")
        return _BY_NAME[value]

    @staticmethod
    def weighted_kind(*, causal: bool, multihead: bool) -> Kind:
        """The trainable kind with these flags (``self``, ``causal``, ``multihead``, ...)."""
        return next(
            k
            for k in _BY_NAME.values()
            if k.weighted and not k.cross and (k.causal, k.multihead) == (causal, multihead)
        )


_BY_NAME = {
    k.name: k
    for k in (
        Kind("scores", weighted=False, one_query=True),
        Kind("simplified", weighted=False),
        Kind("self", weighted=True),
        Kind("causal", weighted=True, causal=True),
        Kind("multihead", weighted=True, multihead=True),
        Kind("causal-multihead", weighted=True, causal=True, multihead=True),
        Kind("cross", weighted=True, multihead=True, cross=True),
    )
}

#: Kinds of attention the library and the checker handle, from the weightless scores of one
#: query to causal multi-head, and cross-attention (keys and values from another sequence).
KINDS = ("scores", "simplified", "self", "causal", "multihead", "causal-multihead", "cross")


class Stage(str, Enum):
    """One named tensor of the pipeline; members are ordered as the pipeline runs."""

    QUERY = "query"
    QUERIES = "queries"
    KEYS = "keys"
    VALUES = "values"
    NORMED_QUERIES = "normed_queries"
    NORMED_KEYS = "normed_keys"
    ROTATED_QUERIES = "rotated_queries"
    ROTATED_KEYS = "rotated_keys"
    SCORES = "scores"
    SCALED_SCORES = "scaled_scores"
    BIASED_SCORES = "biased_scores"
    MASKED_SCORES = "masked_scores"
    WEIGHTS = "weights"
    CONTEXT = "context"
    OUTPUT = "output"

    def __str__(self) -> str:
        return self.value

    @property
    def order(self) -> int:
        """Position in the pipeline (``query`` is 0)."""
        return list(Stage).index(self)

    @property
    def rule(self) -> str:
        """The sentence that predicts this stage's shape."""
        return _RULES[self]

    def predict_shape(self, dims: Dims) -> tuple[int, ...]:
        """The shape this stage must have for inputs and sizes ``dims``."""
        return dims.shape_of(self)


#: The ``(T, T)`` stages, one row per query and one column per key (what a heatmap shows).
MATRIX_STAGES = (
    Stage.SCORES,
    Stage.SCALED_SCORES,
    Stage.BIASED_SCORES,
    Stage.MASKED_SCORES,
    Stage.WEIGHTS,
)

_KV_RULE = "one row per token, d_out columns (per head: head_dim columns; kv_heads heads)"
_RULES = {
    Stage.QUERY: "one vector: the query token's row, with d_k features",
    Stage.QUERIES: "one row per token, d_out columns (per head: head_dim columns)",
    Stage.KEYS: _KV_RULE,
    Stage.VALUES: _KV_RULE,
    Stage.NORMED_QUERIES: "same shape as queries: each query vector normalised (QK norm)",
    Stage.NORMED_KEYS: "same shape as keys: each key vector normalised (QK norm)",
    Stage.ROTATED_QUERIES: "same shape as queries: each pair of features rotated by its position",
    Stage.ROTATED_KEYS: "same shape as keys: each pair of features rotated by its position",
    Stage.SCORES: "one row per query, one column per key: tokens x tokens",
    Stage.SCALED_SCORES: "same shape as scores: each score divided by sqrt(d_k)",
    Stage.BIASED_SCORES: "same shape as scores: a position bias added (ALiBi or learned)",
    Stage.MASKED_SCORES: "same shape as scores: keys after the query set to -inf",
    Stage.WEIGHTS: "same shape as scores: each row is positive and sums to 1",
    Stage.CONTEXT: "one row per token, d_out columns (per head: head_dim columns)",
    Stage.OUTPUT: "one row per token, d_out columns: heads merged and projected",
}


@dataclass(frozen=True)
class Dims:
    """Sizes that determine every stage's shape.

    ``batch`` is ``None`` for unbatched input ``(tokens, d_in)``; ``num_heads`` is ``None``
    for single-head attention (then per-head stages have no head axis). ``kv_heads``
    (grouped heads: keys and values have fewer heads), ``head_size`` (a head width other
    than ``d_out // num_heads``) and ``key_tokens`` (cross-attention: keys from another
    sequence) default to the plain case; ``one_query`` is the ``scores`` kind's single row;
    ``rows`` is a row trace's count of chosen queries (its matrix stages are ``(..., rows, S)``).
    """

    tokens: int
    d_in: int
    d_out: int
    batch: int | None = None
    num_heads: int | None = None
    kv_heads: int | None = None
    head_size: int | None = None
    key_tokens: int | None = None
    one_query: bool = False  # the ``scores`` kind: one query's scores, (T,)
    rows: int | None = None  # a row trace: the matrix stages keep this many query rows

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_out // (self.num_heads or 1)

    @property
    def d_k(self) -> int:
        """The key dimension the scores are scaled by: ``head_dim`` (``d_out`` for one head)."""
        return self.head_dim

    def shape_of(self, stage: Stage) -> tuple[int, ...]:
        lead = () if self.batch is None else (self.batch,)
        heads = () if self.num_heads is None else (self.num_heads,)
        kv = heads if self.kv_heads is None else (self.kv_heads,)
        t, s = self.tokens, self.key_tokens or self.tokens
        if stage is Stage.QUERY:
            return (self.head_dim,)
        if stage in (Stage.QUERIES, Stage.NORMED_QUERIES, Stage.ROTATED_QUERIES, Stage.CONTEXT):
            return (*lead, *heads, t, self.head_dim)
        if stage in (Stage.KEYS, Stage.VALUES, Stage.NORMED_KEYS, Stage.ROTATED_KEYS):
            return (*lead, *kv, s, self.head_dim)
        if stage is Stage.OUTPUT:
            return (*lead, t, self.d_out)
        if self.one_query:
            return (*lead, *heads, s)
        return (*lead, *heads, t if self.rows is None else self.rows, s)


def stages_for_kind(kind: str | Kind) -> tuple[Stage, ...]:
    """The stages a pipeline of ``kind`` produces, in order."""
    k = Kind.of(kind)
    if k.one_query:
        return (Stage.QUERY, Stage.SCORES)
    if not k.weighted:
        return (Stage.SCORES, Stage.WEIGHTS, Stage.CONTEXT)
    base = [Stage.QUERIES, Stage.KEYS, Stage.VALUES, Stage.SCORES, Stage.SCALED_SCORES]
    if k.causal:
        base.append(Stage.MASKED_SCORES)
    base += [Stage.WEIGHTS, Stage.CONTEXT]
    if k.multihead:
        base.append(Stage.OUTPUT)
    return tuple(base)
