"""One small, pure function per stage of self-attention.

Shapes use ``T`` for tokens, ``B`` for batch, ``H`` for heads. Functions that make sense
for both accept unbatched ``(T, d)`` and batched ``(B, T, d)`` input (and ``(B, H, T, d)``
per-head input); the last two axes are always (tokens, features) or (queries, keys).

The explicit pipeline (see :func:`attend`) is what the modules and the traces run. The
checker keeps its own float64 copy (``attnscope.checking.reference``), because it must
change one step at a time to replay known mistakes; its tests hold the two to the same
numbers.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from ..errors import AttnScopeError, check_tensor, describe
from ..stages import Stage
from .variants import sliding_window_mask

__all__ = [
    "query_scores_loop",
    "query_scores_dot",
    "query_scores",
    "attention_scores",
    "normalize_sum",
    "softmax_naive",
    "softmax",
    "scale_scores",
    "causal_mask",
    "apply_causal_mask",
    "context_vectors",
    "split_heads",
    "merge_heads",
    "attend",
    "simplified_attention",
]

Record = MutableMapping[str, torch.Tensor]


def _one_query(inputs: object, query: object) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = check_tensor(inputs, name="inputs", ranks=(2,))
    query = check_tensor(query, name="query", ranks=(1,))
    if query.shape[0] != inputs.shape[1]:
        raise AttnScopeError(
            f"query: expected {inputs.shape[1]} features to match inputs {tuple(inputs.shape)}, "
            f"got {describe(query)}"
        )
    return inputs, query


def _check_dim(dim: object, scores: torch.Tensor) -> int:
    """``dim`` as an axis of ``scores`` (negative counts from the end), or one clear error."""
    r = scores.dim()
    if isinstance(dim, bool) or not isinstance(dim, int) or not -r <= dim < r:
        raise AttnScopeError(
            f"dim: expected an axis from {-r} to {r - 1} of scores with shape "
            f"{tuple(scores.shape)}, got {describe(dim)}"
        )
    return dim


def query_scores_loop(inputs: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Scores of one query against every token, with a hand-written multiply-and-sum.

    Args:
        inputs: ``(T, d)`` one row per token.
        query: ``(d,)`` the query vector (for example ``inputs[1]``).

    Returns:
        ``(T,)``: ``scores[i] = sum_k inputs[i, k] * query[k]``. Slow on purpose: it is the
        dot product written out, to check :func:`query_scores_dot` against.
    """
    inputs, query = _one_query(inputs, query)
    scores = torch.empty(inputs.shape[0], dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        total = 0.0
        for a, b in zip(x_i.tolist(), query.tolist(), strict=True):
            total += a * b
        scores[i] = total
    return scores


def query_scores_dot(inputs: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Scores of one query against every token, one ``torch.dot`` per token.

    Args:
        inputs: ``(T, d)``.
        query: ``(d,)``.

    Returns:
        ``(T,)``, the same numbers as :func:`query_scores_loop`.
    """
    inputs, query = _one_query(inputs, query)
    scores = torch.empty(inputs.shape[0], dtype=inputs.dtype)
    for i, x_i in enumerate(inputs):
        scores[i] = torch.dot(x_i, query)
    return scores


def query_scores(inputs: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Scores of one query against every token, vectorised: ``inputs @ query``.

    Args:
        inputs: ``(T, d)``.
        query: ``(d,)``.

    Returns:
        ``(T,)``, the same numbers as the two loops.
    """
    inputs, query = _one_query(inputs, query)
    return inputs @ query


def attention_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The full score matrix: one row per query, one column per key.

    Args:
        queries: ``(..., T, d_k)``.
        keys: ``(..., T, d_k)``.

    Returns:
        ``(..., T, T)`` with ``scores[..., i, j] = queries[..., i, :] . keys[..., j, :]``.
    """
    queries = check_tensor(queries, name="queries", ranks=(2, 3, 4))
    keys = check_tensor(keys, name="keys", ranks=(2, 3, 4))
    if queries.shape[:-2] != keys.shape[:-2] or queries.shape[-1] != keys.shape[-1]:
        raise AttnScopeError(
            f"keys: expected the leading and feature dimensions of queries "
            f"{tuple(queries.shape)}, got {describe(keys)}"
        )
    return queries @ keys.transpose(-2, -1)


def normalize_sum(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Divide each score by the sum of its row: weights keep the scores' proportions.

    Only meaningful for positive scores (a zero or negative sum gives inf or sign flips);
    the book shows it before softmax to explain normalisation.

    Args:
        scores: ``(..., T)``.
        dim: the axis that must sum to 1.
    """
    scores = check_tensor(scores, name="scores", ranks=(1, 2, 3, 4))
    dim = _check_dim(dim, scores)
    return scores / scores.sum(dim=dim, keepdim=True)


def softmax_naive(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(s) / sum(exp(s))`` written out. Unstable on purpose.

    ``exp`` overflows to ``inf`` for scores above about 88 in float32 (709 in float64), and
    ``inf / inf`` is NaN; :func:`softmax` subtracts the row maximum first and does not.
    Kept to show why the stable version exists.

    Args:
        scores: ``(..., T)``.
        dim: the axis that must sum to 1.
    """
    scores = check_tensor(scores, name="scores", ranks=(1, 2, 3, 4), finite=False)
    dim = _check_dim(dim, scores)
    exp = torch.exp(scores)
    return exp / exp.sum(dim=dim, keepdim=True)


def softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The stable softmax (``torch.softmax``): positive weights that sum to 1 along ``dim``.

    ``-inf`` scores (masked keys) get weight 0; a row that is entirely ``-inf`` gives NaN.

    Args:
        scores: ``(..., T)``.
        dim: the axis that must sum to 1 (the keys: ``-1``).
    """
    scores = check_tensor(scores, name="scores", ranks=(1, 2, 3, 4), finite=False)
    return torch.softmax(scores, dim=_check_dim(dim, scores))


def scale_scores(scores: torch.Tensor, d_k: int) -> torch.Tensor:
    """Divide scores by ``sqrt(d_k)``, the key dimension (``head_dim`` per head).

    Without it, dot products grow with ``d_k`` and the softmax saturates into near one-hot
    rows with vanishing gradients.

    Args:
        scores: ``(..., T, T)``.
        d_k: the keys' feature count, ``keys.shape[-1]``.
    """
    scores = check_tensor(scores, name="scores", ranks=(1, 2, 3, 4), finite=False)
    if isinstance(d_k, bool) or not isinstance(d_k, int) or d_k <= 0:
        raise AttnScopeError(f"d_k: expected a positive integer, got {describe(d_k)}")
    return scores / d_k**0.5


def causal_mask(tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions a causal query must not see: ``True`` above the diagonal.

    Returns:
        ``(tokens, tokens)`` bool, ``mask[i, j] = j > i`` (key j comes after query i).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise AttnScopeError(f"tokens: expected a positive integer, got {describe(tokens)}")
    return torch.ones(tokens, tokens, dtype=torch.bool, device=device).triu(diagonal=1)


def apply_causal_mask(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Set the scores of future keys to ``-inf`` so the softmax gives them weight 0.

    Args:
        scores: ``(..., T, T)``.
        mask: ``(T, T)`` bool (or 0/1), ``True`` where hidden; a larger mask (a module's
            ``context_length`` buffer) is cropped to its top-left ``(T, T)``;
            :func:`causal_mask` when omitted.
    """
    scores = check_tensor(scores, name="scores", ranks=(2, 3, 4), finite=False)
    t_q, t_k = scores.shape[-2:]
    if mask is None:
        if t_q != t_k:
            raise AttnScopeError(f"scores: expected a square (T, T) matrix, got {describe(scores)}")
        mask = causal_mask(t_q, device=scores.device)
    else:
        _check_mask(mask, t_q, t_k, scores)
        if mask.shape[-2:] != (t_q, t_k):
            mask = mask[..., :t_q, :t_k]
    return scores.masked_fill(mask.bool(), -torch.inf)


def _check_mask(mask: object, t_q: int, t_k: int, scores: torch.Tensor) -> None:
    """A mask covering ``(t_q, t_k)`` scores, or one clear error."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        raise AttnScopeError(
            f"mask: expected a (T, T) tensor, True where hidden, got {describe(mask)}"
        )
    if mask.shape[-2] < t_q or mask.shape[-1] < t_k:
        raise AttnScopeError(
            f"mask: expected at least ({t_q}, {t_k}) to cover scores {tuple(scores.shape)}, "
            f"got {describe(mask)}"
        )


def context_vectors(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each token's context vector: the weighted sum of all value rows.

    Args:
        weights: ``(..., T, T)`` rows sum to 1.
        values: ``(..., T, d_v)``.

    Returns:
        ``(..., T, d_v)``: ``context[..., i, :] = sum_j weights[..., i, j] * values[..., j, :]``.
    """
    weights = check_tensor(weights, name="weights", ranks=(2, 3, 4), finite=False)
    values = check_tensor(values, name="values", ranks=(2, 3, 4))
    if weights.shape[-1] != values.shape[-2]:
        raise AttnScopeError(
            f"values: expected {weights.shape[-1]} rows to match weights "
            f"{tuple(weights.shape)}, got {describe(values)}"
        )
    try:
        torch.broadcast_shapes(weights.shape[:-2], values.shape[:-2])
    except RuntimeError:
        raise AttnScopeError(
            f"values: expected leading (batch, head) dimensions that match weights "
            f"{tuple(weights.shape)}, got {describe(values)}"
        ) from None
    return weights @ values


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, T, d_out) -> (B, H, T, head_dim)``: head h gets features ``h*head_dim:(h+1)*head_dim``.

    The view must cut the feature axis (``view(B, T, H, head_dim)``) and only then move the
    head axis forward; ``view(B, H, T, head_dim)`` would mix tokens into heads.
    """
    x = check_tensor(x, name="x", ranks=(3,), finite=False)
    b, t, d = x.shape
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise AttnScopeError(f"num_heads: expected a positive integer, got {describe(num_heads)}")
    if d % num_heads:
        raise AttnScopeError(
            f"num_heads: expected a divisor of d_out={d}, got num_heads={num_heads}"
        )
    return x.view(b, t, num_heads, d // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, head_dim) -> (B, T, H * head_dim)``, the inverse of :func:`split_heads`."""
    x = check_tensor(x, name="x", ranks=(4,), finite=False)
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


def check_qkv(queries: object, keys: object, values: object) -> None:
    """Types, ranks, dtypes and shapes of queries, keys and values: O(1), no value scans.

    ``(..., T, d)`` each; keys and values ``(B, K, S, d)`` with ``K`` dividing the queries'
    heads are grouped heads."""
    for name, t in (("queries", queries), ("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise AttnScopeError(f"{name}: expected a torch.Tensor, got {describe(t)}")
        if not 2 <= t.dim() <= 4:
            raise AttnScopeError(
                f"{name}: expected shape (T, d), (B, T, d) or (B, H, T, d), got {describe(t)}"
            )
        if not t.is_floating_point():
            raise AttnScopeError(f"{name}: expected a floating-point tensor, got {describe(t)}")
    assert isinstance(queries, torch.Tensor)  # for type checkers; checked above
    assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
    if keys.dtype != queries.dtype or values.dtype != queries.dtype:
        raise AttnScopeError(
            f"keys, values: expected the dtype of queries {describe(queries)}, got "
            f"{describe(keys)} and {describe(values)}"
        )
    grouped = (
        queries.dim() == 4
        and keys.dim() == 4
        and keys.shape[0] == queries.shape[0]
        and 0 < keys.shape[1] < queries.shape[1]
        and queries.shape[1] % keys.shape[1] == 0
    )  # grouped key/value heads: K heads shared by H // K query heads each
    if (keys.shape[:-2] != queries.shape[:-2] and not grouped) or keys.shape[-1] != queries.shape[
        -1
    ]:
        raise AttnScopeError(
            f"keys: expected the leading and feature dimensions of queries "
            f"{tuple(queries.shape)} (or a divisor of its heads), got {describe(keys)}"
        )
    if values.shape[:-1] != keys.shape[:-1]:
        raise AttnScopeError(
            f"values: expected one row per key, leading dimensions and tokens of keys "
            f"{tuple(keys.shape)}, got {describe(values)}"
        )


def _check_attend(
    queries: object, keys: object, values: object, causal: bool, mask: object
) -> None:
    """Types, ranks, dtypes and shapes of :func:`attend`'s inputs: O(1), no value scans."""
    check_qkv(queries, keys, values)
    if causal:
        t_q, t_k = queries.shape[-2], keys.shape[-2]
        if t_q != t_k:
            raise AttnScopeError(
                f"keys: expected as many tokens as queries {tuple(queries.shape)} for causal "
                f"attention, got {describe(keys)}"
            )
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                raise AttnScopeError(
                    f"mask: expected a (T, T) tensor, True where hidden, got {describe(mask)}"
                )
            if mask.shape[0] < t_k or mask.shape[1] < t_k:
                raise AttnScopeError(
                    f"mask: expected at least ({t_k}, {t_k}) for {t_k} tokens, got {describe(mask)}"
                )


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    dropout: torch.nn.Module | None = None,
    record: Record | None = None,
    bias: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The explicit attention core, stage by stage, on projected queries, keys and values.

    scores -> scaled_scores -> [biased_scores] -> [masked_scores] -> weights -> context.
    The book masks before scaling; scaling first is the same numbers (``-inf / c`` is
    ``-inf``) and matches the stage order.

    Args:
        queries, keys, values: ``(..., T, d_k)``; ``...`` is ``()``, ``(B,)`` or ``(B, H)``.
            Keys and values ``(B, K, T, d_k)`` with ``K`` dividing ``H`` are grouped heads:
            query head h reads key/value head ``h // (H // K)``.
        causal: hide future keys (``mask``, :func:`causal_mask`, or the ``window``).
        mask: ``(>=T, >=T)`` bool, ``True`` where hidden; cropped to ``T``.
        dropout: applied to the weights after they are recorded (identity in eval mode).
        record: when given, every stage's tensor is stored in it under its stage name.
        bias: ``(..., T, T_k)`` added to the scaled scores (ALiBi, a learned bias).
        window: with ``causal``, each query sees its last ``window`` keys, itself included
            (:func:`~attnscope.functional.sliding_window_mask`).
        scale: the factor the scores are multiplied by (default ``1 / sqrt(d_k)``).

    Returns:
        ``(..., T, d_v)`` context vectors.

    The inputs' types, ranks, dtypes and shapes are checked (cheaply: no pass over the
    values), so a mismatch is one :class:`AttnScopeError` rather than a matmul error.
    """
    _check_attend(queries, keys, values, causal, mask)
    if window is not None and not causal:
        raise AttnScopeError(f"window: expected causal=True with a sliding window, got {window}")
    if keys.dim() == 4 and keys.shape[1] != queries.shape[1]:  # grouped key/value heads
        group = queries.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = queries @ keys.transpose(-2, -1)
    hide = None
    if causal:
        t_q, t = scores.shape[-2], scores.shape[-1]
        if window is not None:
            hide = sliding_window_mask(t_q, window, t, device=scores.device)
        else:
            hide = causal_mask(t, scores.device) if mask is None else mask.bool()[:t, :t]
    factor = keys.shape[-1] ** -0.5 if scale is None else scale
    biased = masked = None
    if record is None and bias is None:
        # Nobody keeps the stages: scale and mask the score buffer in place (as the book's
        # masked_fill_ does). Each (T, T) buffer costs a fresh allocation and a memory pass,
        # which dominates on long inputs; autograd is unaffected (mul and masked_fill do not
        # need their outputs for backward, matmul does not need its output).
        scaled = scores.mul_(factor) if scale is not None else scores.div_(keys.shape[-1] ** 0.5)
        if hide is not None:
            scaled.masked_fill_(hide, -torch.inf)
        logits = scaled
    else:
        scaled = scores * factor if scale is not None else scores / keys.shape[-1] ** 0.5
        logits = scaled
        if bias is not None:
            biased = logits = scaled + bias.to(scaled.dtype)
        if hide is not None:
            # Adding 0 / -inf equals masked_fill(hide, -inf) for finite scores, in one pass
            # instead of a copy and a fill: tracing long inputs stays close to forward.
            fill = torch.zeros(hide.shape, dtype=scaled.dtype, device=scaled.device)
            masked = logits = logits + fill.masked_fill_(hide, -torch.inf)
    weights = torch.softmax(logits, dim=-1)
    context = (weights if dropout is None else dropout(weights)) @ values
    if record is not None:
        record.update({Stage.SCORES.value: scores, Stage.SCALED_SCORES.value: scaled})
        if biased is not None:
            record[Stage.BIASED_SCORES.value] = biased
        if masked is not None:
            record[Stage.MASKED_SCORES.value] = masked
        record.update({Stage.WEIGHTS.value: weights, Stage.CONTEXT.value: context})
    return context


def simplified_attention(inputs: torch.Tensor, record: Record | None = None) -> torch.Tensor:
    """Attention without trainable weights (the book's section 3.3).

    ``scores = inputs @ inputs^T``, ``weights = softmax(scores)`` (no scaling),
    ``context = weights @ inputs``.

    Args:
        inputs: ``(T, d)`` or ``(B, T, d)``.
        record: when given, receives ``scores``, ``weights`` and ``context``.

    Returns:
        ``(T, d)`` or ``(B, T, d)`` context vectors.
    """
    inputs = check_tensor(inputs, name="inputs", ranks=(2, 3))
    scores = inputs @ inputs.transpose(-2, -1)
    weights = torch.softmax(scores, dim=-1)
    context = weights @ inputs
    if record is not None:
        record.update(
            {Stage.SCORES.value: scores, Stage.WEIGHTS.value: weights, Stage.CONTEXT.value: context}
        )
    return context
