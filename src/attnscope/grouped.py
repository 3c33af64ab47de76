"""Modern attention: grouped key/value heads, rotary positions, QK norm, windows, ALiBi.

:class:`GroupedQueryAttention` is the attention of Llama, Mistral, Qwen and Gemma, and of the
book's bonus chapters (``llms_from_scratch.llama3`` / ``qwen3``), with every stage visible:
the same explicit path / fast path / trace design as :mod:`attnscope.modules`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as AF
from .errors import AttnScopeError, check_embeddings, describe
from .trace import Traceable

__all__ = ["GroupedQueryAttention", "RMSNorm", "QK_NORMS"]

#: Where a QK norm normalises: over each head's features (Qwen 3, Gemma 3) or over the whole
#: projection before the heads are split (OLMo 2).
QK_NORMS = ("per-head", "full")

# scaled_dot_product_attention learned enable_gqa in torch 2.5; before, repeat by hand.
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AttnScopeError(f"{name}: expected a positive integer, got {describe(value)}")
    return value


class RMSNorm(nn.Module):
    """RMSNorm with a learned ``weight`` (ones at first): the QK norm's module."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(_positive_int("dim", dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return AF.rms_norm(x, self.weight, self.eps)


class GroupedQueryAttention(Traceable):
    """Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` key/value
    heads (query head h reads key/value head ``h // (num_heads // num_kv_heads)``).

    ``num_kv_heads`` runs from ``num_heads`` (multi-head attention) down to 1 (multi-query).
    Options, each off or standard by default as in Llama 3:

    * ``rope`` (on unless ``alibi`` or ``cross``): rotary position embedding on queries and
      keys, with ``rope_base``, ``rope_fraction`` of each head rotated (GPT-NeoX) and
      ``rope_pairing`` ``"half"``
      (Hugging Face, the book) or ``"interleaved"`` (Meta's complex-number code). The
      inverse frequencies are the buffer ``inv_freq``: overwrite it for a scaled scheme.
    * ``qk_norm``: RMSNorm on queries and keys before the rotation, ``"per-head"`` or
      ``"full"`` (see :data:`QK_NORMS`).
    * ``window``: with ``causal``, each query sees its last ``window`` keys (Mistral).
    * ``alibi``: ALiBi's per-head linear bias on the scaled scores (BLOOM, MPT).
    * ``cross``: keys and values from a second input, ``forward(x, context)``; not causal,
      no rotation (``causal`` defaults to ``not cross``).

    Weights: ``W_query`` ``(d_in -> num_heads * head_dim)``, ``W_key`` and ``W_value``
    ``(d_in -> num_kv_heads * head_dim)``, ``out_proj`` ``(num_heads * head_dim -> d_out)``
    (no biases unless ``qkv_bias``, as in Llama), ``q_norm``/``k_norm`` with ``qk_norm``.
    ``head_dim`` defaults to ``d_out // num_heads``.

    The fast path (the default) hands the core to
    :func:`torch.nn.functional.scaled_dot_product_attention` (``enable_gqa`` where torch has
    it); the explicit path records every stage and is the one :meth:`trace` runs.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        causal: bool | None = None,
        rope: bool | None = None,
        rope_base: float = 10_000.0,
        rope_fraction: float = 1.0,
        rope_pairing: str = "half",
        qk_norm: str | None = None,
        window: int | None = None,
        alibi: bool = False,
        cross: bool = False,
        qkv_bias: bool = False,
        dropout: float = 0.0,
        use_fast_path: bool = True,
    ):
        super().__init__()
        self.d_in, self.d_out = _positive_int("d_in", d_in), _positive_int("d_out", d_out)
        self.num_heads = _positive_int("num_heads", num_heads)
        kv = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        if num_heads % kv:
            raise AttnScopeError(
                f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {kv}"
            )
        self.num_kv_heads, self.group = kv, num_heads // kv
        if head_dim is None:
            if d_out % num_heads:
                raise AttnScopeError(
                    f"num_heads: expected a divisor of d_out={d_out} (or pass head_dim), "
                    f"got num_heads={num_heads}"
                )
            head_dim = d_out // num_heads
        self.head_dim = _positive_int("head_dim", head_dim)
        causal = not cross if causal is None else causal
        rope = not (cross or alibi) if rope is None else rope
        if cross and (causal or rope or alibi or window is not None):
            raise AttnScopeError(
                "cross: expected a cross-attention layer without causal mask, rotary "
                "embedding, ALiBi or window (its keys are another sequence's), got "
                f"causal={causal}, rope={rope}, alibi={alibi}, window={window}"
            )
        if qk_norm not in (None, *QK_NORMS):
            raise AttnScopeError(
                f"qk_norm: expected None or one of {', '.join(QK_NORMS)}, got {qk_norm!r}"
            )
        if window is not None:
            _positive_int("window", window)
            if not causal:
                raise AttnScopeError(f"window: expected causal=True with a window, got {window}")
        if rope_pairing not in AF.PAIRINGS:
            raise AttnScopeError(
                f"rope_pairing: expected one of {', '.join(AF.PAIRINGS)}, got {rope_pairing!r}"
            )
        if not 0 <= dropout < 1:
            raise AttnScopeError(f"dropout: expected a probability in [0, 1), got {dropout!r}")
        self.causal, self.cross, self.alibi = bool(causal), bool(cross), bool(alibi)
        self.rope, self.rope_pairing, self.rope_base = bool(rope), rope_pairing, float(rope_base)
        self.rope_fraction = float(rope_fraction)
        self.qk_norm, self.window = qk_norm, window
        self.use_fast_path = bool(use_fast_path)

        q_width, kv_width = num_heads * self.head_dim, kv * self.head_dim
        self.W_query = nn.Linear(d_in, q_width, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, kv_width, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, kv_width, bias=qkv_bias)
        self.out_proj = nn.Linear(q_width, d_out, bias=False)
        self.q_norm = self.k_norm = None
        if qk_norm == "per-head":
            self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        elif qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(q_width), RMSNorm(kv_width)
        self.dropout = nn.Dropout(dropout)
        freqs = AF.rope_frequencies(self.head_dim, rope_base, rope_fraction) if rope else None
        self.register_buffer("inv_freq", None if freqs is None else freqs.float())
        self._table_cache: dict = {}
        slopes = AF.alibi_slopes(num_heads).float() if alibi else None
        self.register_buffer("alibi_slopes", slopes)

    @property
    def kind(self) -> str:  # type: ignore[override]
        if self.cross:
            return "cross"
        return "causal-multihead" if self.causal else "multihead"

    # --- the stages ---------------------------------------------------------------------

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def _angles(self, tokens: int, offset: int, device: torch.device) -> torch.Tensor:
        return AF.rope_angles(tokens, self.inv_freq, offset).to(device)

    def _tables(self, tokens: int, offset: int, like: torch.Tensor):
        """``(cos, sin)`` ``(T, R/2)`` for positions ``offset..``, made once per size, dtype
        and device (and again if ``inv_freq`` is overwritten)."""
        key = (tokens, offset, like.dtype, like.device, self.inv_freq._version)
        if key not in self._table_cache:
            if len(self._table_cache) > 8:
                self._table_cache.clear()
            angles = self._angles(tokens, offset, like.device)
            self._table_cache[key] = (angles.cos().to(like.dtype), angles.sin().to(like.dtype))
        return self._table_cache[key]

    def _queries_keys_values(self, x, context, offset, record):
        """Project, split into heads, norm and rotate: ``(B, H, T, D)``, ``(B, K, S, D)`` x 2."""
        source = x if context is None else context
        q, k, v = self.W_query(x), self.W_key(source), self.W_value(source)
        if self.qk_norm == "full":  # over the whole projection, before the heads are split
            nq, nk = self.q_norm(q), self.k_norm(k)
        q, k, v = (
            self._split(t, h)
            for t, h in ((q, self.num_heads), (k, self.num_kv_heads), (v, self.num_kv_heads))
        )
        if record is not None:
            record.update(queries=q, keys=k, values=v)
        if self.qk_norm is not None:
            if self.qk_norm == "full":
                q, k = self._split(nq, self.num_heads), self._split(nk, self.num_kv_heads)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            if record is not None:
                record.update(normed_queries=q, normed_keys=k)
        if self.rope:
            q = AF.rotate_pairs(q, *self._tables(q.shape[-2], offset, q), self.rope_pairing)
            k = AF.rotate_pairs(k, *self._tables(k.shape[-2], offset, k), self.rope_pairing)
            if record is not None:
                record.update(rotated_queries=q, rotated_keys=k)
        return q, k, v

    def _values(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, K, S, D)``: the values stage alone (a row trace makes it again on read)."""
        return self._split(self.W_value(x if context is None else context), self.num_kv_heads)

    def _bias(self, t_q: int, t_k: int, like: torch.Tensor) -> torch.Tensor | None:
        """``(H, T, S)`` ALiBi bias, or None."""
        if not self.alibi:
            return None
        return AF.alibi_bias(self.alibi_slopes, t_q, t_k).to(like.dtype).to(like.device)

    def _check_inputs(self, x: object, context: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self._check(x)
        if self.cross:
            if context is None:
                raise AttnScopeError(
                    "context: expected the (B, S, d_in) input the keys and values come from "
                    "(a cross-attention layer), got None"
                )
            context = check_embeddings(context, name="context", d_in=self.d_in)
            if context.dim() != x.dim() or (x.dim() == 3 and context.shape[0] != x.shape[0]):
                raise AttnScopeError(
                    f"context: expected the batch of x {tuple(x.shape)}, got {describe(context)}"
                )
        elif context is not None:
            raise AttnScopeError(
                f"context: expected None for self-attention (cross=False), got {describe(context)}"
            )
        return x, context

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, *, offset: int = 0
    ) -> torch.Tensor:
        """``(B, T, d_in)`` (or ``(T, d_in)``) -> same leading shape with ``d_out`` features.

        ``context`` ``(B, S, d_in)``: what cross-attention attends to. ``offset``: the
        position of the first token (rotary embeddings), 0 for a whole sequence.
        """
        x, context = self._check_inputs(x, context)
        if not self.use_fast_path:
            return self._pipeline(x, None, context=context, offset=offset)
        return self._fast(x, context, offset)

    def _fast(self, x, context, offset):
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
            context = None if context is None else context.unsqueeze(0)
        b, t, _ = x.shape
        q, k, v = self._queries_keys_values(x, context, offset, None)
        kwargs = {}
        if self.group > 1:
            if _SDPA_GQA:
                kwargs["enable_gqa"] = True
            else:
                k, v = AF.repeat_kv(k, self.group), AF.repeat_kv(v, self.group)
        bias = self._bias(t, k.shape[-2], q)
        hide = None
        if self.causal and self.window is not None:
            hide = AF.sliding_window_mask(t, self.window, k.shape[-2], device=q.device)
        if bias is None and hide is None:
            mask, is_causal = None, self.causal
        else:  # one additive mask: the bias, and -inf where hidden
            mask = torch.zeros(t, k.shape[-2], dtype=q.dtype, device=q.device)
            if self.causal and hide is None:
                hide = AF.causal_mask(t, q.device)
            if hide is not None:
                mask = mask.masked_fill(hide, -torch.inf)
            mask = mask if bias is None else mask + bias
            is_causal = False
        p = self.dropout.p if self.training else 0.0
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, **kwargs
        )
        out = self.out_proj(ctx.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
        return out.squeeze(0) if unbatched else out

    def _pipeline(
        self,
        x: torch.Tensor,
        record: AF.Record | None,
        *,
        context: torch.Tensor | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
            context = None if context is None else context.unsqueeze(0)
        q, k, v = self._queries_keys_values(x, context, offset, record)
        ctx = self._attend(
            q,
            k,
            v,
            record,
            causal=self.causal,
            window=self.window,
            slopes=self.alibi_slopes if self.alibi else None,
            dropout=self.dropout,
        )
        del v  # a row trace makes the values again when read: not held beside the output
        out = self.out_proj(AF.merge_heads(ctx))  # (B, T, d_out)
        return self._output(out, record, unbatched)

    # --- one query alone (Trace.walk) ------------------------------------------------------

    def _walk_query(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """``(H, D)`` the query of one ``(d_in,)`` token at ``position``, every step alone."""
        q = self.W_query(token)
        if self.qk_norm == "full":
            q = self.q_norm(q)
        q = q.view(self.num_heads, self.head_dim)
        if self.qk_norm == "per-head":
            q = self.q_norm(q)
        if self.rope:
            q = AF.apply_rope(
                q.unsqueeze(-2), self._angles(1, position, q.device), self.rope_pairing
            )
            q = q.squeeze(-2)
        return q

    def _query_bound(self, token: torch.Tensor) -> tuple[torch.Tensor, float]:
        """:meth:`Traceable._query_bound` through the norm and the rotation."""
        bound, amplified = super()._query_bound(token)  # (H * D,) from |x| @ |W| (+ |b|)
        if self.qk_norm is not None:
            # The norm divides by the query's own size (per head or whole): scale the bound
            # the same way; the division's own rounding counts the projection's again.
            q = self.W_query(token)
            width = self.head_dim if self.qk_norm == "per-head" else q.shape[-1]
            q, bound = q.view(-1, width), bound.view(-1, width)
            factor = torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
            bound = (bound * factor * self.q_norm.weight.abs()).flatten()
            amplified = 3.0
        if self.rope:  # each rotated entry mixes its pair: |a cos - b sin| <= |a| + |b|
            heads = bound.view(self.num_heads, self.head_dim)
            rot = 2 * self.inv_freq.shape[0]
            part = heads[:, :rot]
            if self.rope_pairing == "half":
                pair = part[:, : rot // 2] + part[:, rot // 2 :]
                part = torch.cat([pair, pair], dim=-1)
            else:
                pair = part[:, 0::2] + part[:, 1::2]
                part = pair.repeat_interleave(2, dim=-1)
            bound = torch.cat([part, heads[:, rot:]], dim=-1).flatten()
        return bound, amplified

    def _walk_bias(self, position: int, keys: int) -> torch.Tensor | None:
        """``(H, 1, S)`` the bias row of the query at ``position``, or None."""
        if not self.alibi:
            return None
        # row ``position`` of alibi_bias(slopes, keys, keys), built alone (no (H, T, T))
        distance = (torch.arange(keys, dtype=torch.float64) - position).abs()
        return (-self.alibi_slopes.to(torch.float64)[:, None] * distance).unsqueeze(1)

    def _walk_hidden(self, position: int, keys: int) -> torch.Tensor | None:
        """``(1, S)`` the keys hidden from the query at ``position``, or None."""
        if not self.causal:
            return None
        back = position - torch.arange(keys)  # row ``position`` of the (T, S) masks, alone
        hidden = back < 0 if self.window is None else (back < 0) | (back >= self.window)
        return hidden.unsqueeze(0)
