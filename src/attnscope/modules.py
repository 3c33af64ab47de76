"""The book's self-attention classes, built on :mod:`attnscope.functional`.

Parameter names, initialisation order and numerics follow "Build a Large Language Model
From Scratch" (ch. 3), so ``torch.manual_seed(123)`` gives the book's printed numbers.
Every module accepts ``(T, d_in)`` or ``(B, T, d_in)`` and returns the same leading shape
with ``d_out`` features, and every module can be traced (``module.trace(x)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as AF
from .errors import AttnScopeError, describe
from .trace import Traceable

__all__ = ["SelfAttentionV1", "SelfAttentionV2", "CausalAttention", "MultiHeadAttention"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AttnScopeError(f"{name}: expected a positive integer, got {describe(value)}")
    return value


def _probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise AttnScopeError(f"{name}: expected a probability in [0, 1), got {describe(value)}")
    return float(value)


class _BookMask:
    """The book's ``mask`` buffer, without its ``(context_length, context_length)`` memory.

    The book registers ``torch.triu(ones(n, n), 1)`` as a buffer: 16 GiB of floats at 65,536
    tokens. The modules here build their masks per call from positions instead. So that state
    dicts still move both ways, a ``mask`` saved by the book's class is accepted (and
    dropped) on load, and ``state_dict()`` writes one, built at that moment; ``module.mask``
    builds it on request too.
    """

    @staticmethod
    def install(module: nn.Module) -> None:
        module._register_state_dict_hook(_BookMask._save)
        module._register_load_state_dict_pre_hook(_BookMask._load, with_module=True)

    @staticmethod
    def build(n: int) -> torch.Tensor:
        return torch.triu(torch.ones(n, n), diagonal=1)

    @staticmethod
    def _save(module, state, prefix, local_metadata):
        # where torch puts a module's own buffer: before its submodules' entries
        items = list(state.items())
        at = next((i for i, (k, _) in enumerate(items) if k.startswith(prefix)), len(items))
        items.insert(at, (prefix + "mask", _BookMask.build(module.context_length)))
        state.clear()
        state.update(items)
        return state

    @staticmethod
    def _load(module, state, prefix, *args, **kwargs):
        state.pop(prefix + "mask", None)


class SelfAttentionV1(Traceable):
    """Self-attention with ``nn.Parameter`` weight matrices stored ``(d_in, d_out)``.

    ``W_query``, ``W_key``, ``W_value`` are drawn with ``torch.rand`` in that order, as in
    the book, and applied as ``x @ W``.
    """

    kind = "self"

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.d_in, self.d_out = _positive_int("d_in", d_in), _positive_int("d_out", d_out)
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def _values(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        return x @ self.W_value

    def _pipeline(self, x: torch.Tensor, record: AF.Record | None) -> torch.Tensor:
        queries, keys, values = x @ self.W_query, x @ self.W_key, x @ self.W_value
        if record is not None:
            record.update(queries=queries, keys=keys, values=values)
        return self._attend(queries, keys, values, record)

    @classmethod
    def from_v2(cls, v2: SelfAttentionV2) -> SelfAttentionV1:
        """A V1 that computes exactly what ``v2`` computes (``W = linear.weight.T``).

        V1 has no biases, so ``v2`` must have been built with ``qkv_bias=False``.
        """
        if not isinstance(v2, SelfAttentionV2):
            raise AttnScopeError(f"v2: expected a SelfAttentionV2, got {describe(v2)}")
        if v2.W_query.bias is not None:
            raise AttnScopeError(
                "v2: expected a SelfAttentionV2 built with qkv_bias=False (V1 has no biases), "
                "got one with biases"
            )
        with torch.random.fork_rng(devices=[]):  # the random start is overwritten below
            v1 = cls(v2.d_in, v2.d_out)
        like = v2.W_query.weight
        v1 = v1.to(device=like.device, dtype=like.dtype)
        with torch.no_grad():
            for name in ("W_query", "W_key", "W_value"):
                getattr(v1, name).copy_(getattr(v2, name).weight.T)
        return v1


class SelfAttentionV2(Traceable):
    """Self-attention with ``nn.Linear`` projections (weights stored ``(d_out, d_in)``)."""

    kind = "self"

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False):
        super().__init__()
        self.d_in, self.d_out = _positive_int("d_in", d_in), _positive_int("d_out", d_out)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def _values(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        return self.W_value(x)

    def _project(self, x: torch.Tensor, record: AF.Record | None):
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)
        if record is not None:
            record.update(queries=queries, keys=keys, values=values)
        return queries, keys, values

    def _pipeline(self, x: torch.Tensor, record: AF.Record | None) -> torch.Tensor:
        return self._attend(*self._project(x, record), record)

    @classmethod
    def from_v1(cls, v1: SelfAttentionV1) -> SelfAttentionV2:
        """A V2 (without biases) that computes exactly what ``v1`` computes."""
        if not isinstance(v1, SelfAttentionV1):
            raise AttnScopeError(f"v1: expected a SelfAttentionV1, got {describe(v1)}")
        with torch.random.fork_rng(devices=[]):  # the random start is overwritten below
            v2 = cls(v1.d_in, v1.d_out, qkv_bias=False)
        v2 = v2.to(device=v1.W_query.device, dtype=v1.W_query.dtype)
        with torch.no_grad():
            for name in ("W_query", "W_key", "W_value"):
                getattr(v2, name).weight.copy_(getattr(v1, name).T)
        return v2


class CausalAttention(SelfAttentionV2):
    """Single-head causal self-attention with dropout on the weights (the book's 3.5).

    Token ``i`` attends to tokens ``0..i`` only: scores of later keys are set to ``-inf``
    before the softmax. At most ``context_length`` tokens.
    """

    kind = "causal"

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False
    ):
        super().__init__(d_in, d_out, qkv_bias=qkv_bias)
        self.context_length = _positive_int("context_length", context_length)
        self.dropout = nn.Dropout(_probability("dropout", dropout))
        _BookMask.install(self)

    @property
    def mask(self) -> torch.Tensor:
        """The book's ``(context_length, context_length)`` mask (1 above the diagonal), built
        on request: the computation builds its masks per call (see :class:`_BookMask`)."""
        return _BookMask.build(self.context_length)

    def _pipeline(self, x: torch.Tensor, record: AF.Record | None) -> torch.Tensor:
        return self._attend(*self._project(x, record), record, causal=True, dropout=self.dropout)


class MultiHeadAttention(Traceable):
    """Multi-head self-attention with an output projection (the book's 3.6.2).

    ``d_out`` is split into ``num_heads`` heads of ``head_dim = d_out // num_heads``
    features; each head attends on its own and the heads are concatenated and projected
    by ``out_proj``. ``causal=True`` (the book's default) masks future tokens.

    Two paths compute the same result: the fast path (``use_fast_path=True``, the default)
    hands the core to :func:`torch.nn.functional.scaled_dot_product_attention`; the explicit
    path spells out every stage and is the one :meth:`trace` runs.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        causal: bool = True,
        use_fast_path: bool = True,
    ):
        super().__init__()
        self.d_in, self.d_out = _positive_int("d_in", d_in), _positive_int("d_out", d_out)
        self.context_length = _positive_int("context_length", context_length)
        self.num_heads = _positive_int("num_heads", num_heads)
        if d_out % num_heads:
            raise AttnScopeError(
                f"num_heads: expected a divisor of d_out={d_out}, got num_heads={num_heads} "
                f"(d_out % num_heads = {d_out % num_heads})"
            )
        self.head_dim = d_out // num_heads
        self.causal = bool(causal)
        self.use_fast_path = bool(use_fast_path)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(_probability("dropout", dropout))
        _BookMask.install(self)

    @property
    def mask(self) -> torch.Tensor:
        """The book's ``(context_length, context_length)`` mask, built on request (see
        :class:`_BookMask`)."""
        return _BookMask.build(self.context_length)

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "causal-multihead" if self.causal else "multihead"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, d_in)`` or ``(B, T, d_in)`` -> ``(T, d_out)`` or ``(B, T, d_out)``."""
        x = self._check(x)
        return self._pipeline(x, None) if not self.use_fast_path else self._fast(x)

    def _heads(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        b, t, _ = x.shape
        # (B, T, d_out) -> (B, T, H, head_dim) -> (B, H, T, head_dim): cut features, not tokens
        return linear(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def _values(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        return self._heads(x, self.W_value)

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
        b, t, _ = x.shape
        q, k, v = (self._heads(x, lin) for lin in (self.W_query, self.W_key, self.W_value))
        p = self.dropout.p if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        out = self.out_proj(context.transpose(1, 2).reshape(b, t, self.d_out))
        return out.squeeze(0) if unbatched else out

    def _pipeline(self, x: torch.Tensor, record: AF.Record | None) -> torch.Tensor:
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
        q, k, v = (self._heads(x, lin) for lin in (self.W_query, self.W_key, self.W_value))
        if record is not None:
            record.update(queries=q, keys=k, values=v)
        context = self._attend(q, k, v, record, causal=self.causal, dropout=self.dropout)
        del v  # a row trace makes the values again when read: not held beside the output
        out = self.out_proj(AF.merge_heads(context))  # (B, T, d_out)
        return self._output(out, record, unbatched)
