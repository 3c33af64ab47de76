"""Mistakes in the scores and their scale: keys misplaced or transposed, something other
than a dot product, sequences mixed, a missing or wrong scale."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ...stages import Stage
from ..compare import close
from ..reference import Mutation, Spec
from .base import Context, Evidence, define

T = torch.Tensor
_S = Stage.SCORES


def _user_scores(ev: Evidence) -> T | None:
    ref = ev.ref["scores"]
    return ev.user if ev.user is not None and ev.user.shape == ref.shape else None


# ------------------------------------------------------------------ wrong_key_index


def _key_shifted(ev: Evidence) -> bool:
    """Scores written at another key's column: rolled, shifted, or the keys reversed."""
    u = _user_scores(ev)
    if u is None:
        return False
    ref = ev.ref["scores"]
    n = ref.shape[-1]
    for s in range(1, n):
        if close(u, ref.roll(s, dims=-1)):
            return True
        # shifted without wrapping: every column but the leftover one matches
        if close(u[..., : n - s], ref[..., s:]) or close(u[..., s:], ref[..., : n - s]):
            return True
    return close(u, ref.flip(-1))


def _one_query_shifts() -> list:
    out = [
        (_S, f"score of key i written at position i{s:+d}", lambda x, i, s=s: (x @ x[i]).roll(s))
        for s in (1, -1)
    ]
    out.append((_S, "keys reversed", lambda x, i: (x @ x[i]).flip(0)))
    return out


@define(
    "wrong_key_index",
    expected="expected scores[i, j] = query_i . key_j, key j at column j",
    recognise=_key_shifted,
    one_query=_one_query_shifts,
    one_query_expected="Expected scores[j] = inputs[j] . query at index j",
)
def _wrong_key_index(c: Context) -> list[Mutation]:
    out = [
        Mutation(
            "wrong_key_index",
            _S,
            f"key index shifted by {s}",
            scores=lambda q, k, s=s: q @ k.roll(s, dims=-2).mT,
        )
        for s in (1, -1)
    ]
    out.append(
        Mutation("wrong_key_index", _S, "keys reversed", scores=lambda q, k: q @ k.flip(-2).mT)
    )
    return out


# ------------------------------------------------------------------ scores_transposed


def _transposed(ev: Evidence) -> bool:
    u = _user_scores(ev)
    return u is not None and close(u, ev.ref["scores"].mT)


@define(
    "scores_transposed",
    expected="expected queries @ keys.transpose(-2, -1): row i is query i",
    recognise=_transposed,
)
def _scores_transposed(c: Context) -> list[Mutation]:
    return [Mutation("scores_transposed", _S, "keys @ queries^T", scores=lambda q, k: k @ q.mT)]


# ------------------------------------------------------------------ not_dot_product


def _l2(q: T, k: T) -> T:
    """Squared distances ``|q_i - k_j|^2`` without a (..., T, T, d) intermediate."""
    return (q * q).sum(-1, keepdim=True) + (k * k).sum(-1).unsqueeze(-2) - 2 * q @ k.mT


def _not_dot(ev: Evidence) -> bool:
    """The fallback at the scores: a tensor there that is nothing above, or queries and
    keys both right and the scores not made of them."""
    return ev.user is not None or bool(ev.found.get(Stage.QUERIES) and ev.found.get(Stage.KEYS))


def _one_query_not_dot() -> list:
    forms = {
        "cosine similarity": lambda x, i: (x / x.norm(dim=-1, keepdim=True)) @ (x[i] / x[i].norm()),
        "negative squared distance": lambda x, i: -((x - x[i]) ** 2).sum(-1),
        "negative distance": lambda x, i: -((x - x[i]) ** 2).sum(-1).sqrt(),
        "sum of query and key": lambda x, i: x.sum(-1) + x[i].sum(),
        "softmax of the scores": lambda x, i: torch.softmax(x @ x[i], dim=0),
    }
    return [(_S, label, fn) for label, fn in forms.items()]


@define(
    "not_dot_product",
    expected="expected the dot product query_i . key_j",
    recognise=_not_dot,
    one_query=_one_query_not_dot,
    one_query_expected="Expected torch.dot(inputs[j], query)",
)
def _not_dot_product(c: Context) -> list[Mutation]:
    forms = {
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
    return [Mutation("not_dot_product", _S, label, scores=fn) for label, fn in forms.items()]


# ------------------------------------------------------------------ batch_mixing


@define(
    "batch_mixing",
    expected="expected each sequence to attend only to its own tokens (matmul over the last "
    "two dims, batch kept apart)",
)
def _batch_mixing(c: Context) -> list[Mutation]:
    if c.batch < 2:
        return []
    out = [
        Mutation("batch_mixing", _S, "batch folded into the tokens", flatten_batch=True),
        Mutation(
            "batch_mixing",
            _S,
            "each query attends to the keys and values of the whole batch",
            scores=lambda q, k: q @ k.transpose(0, 1).reshape(1, k.shape[1], -1, k.shape[-1]).mT,
            context=lambda w, v: w @ v.transpose(0, 1).reshape(1, v.shape[1], -1, v.shape[-1]),
        ),
        Mutation(
            "batch_mixing",
            _S,
            "batch and tokens exchanged (a (batch, tokens, d) input read as (tokens, batch, d): "
            "batch_first=False?): each position attends across the batch",
            swap_batch=True,
        ),
        Mutation(
            "batch_mixing",
            _S,
            "each query scored against the keys summed over the batch",
            scores=lambda q, k: q @ k.sum(0, keepdim=True).mT,
        ),
    ]
    if c.spec.num_heads > 1:
        # heads folded into the batch (b * h, t, d) in the other order for one side: a
        # (heads, batch) fold read as (batch, heads) pairs a query head with another
        # sequence's key heads
        fold = "folded (heads, batch) into the batch axis, the queries (batch, heads)"
        out += [
            Mutation(
                "batch_mixing",
                _S,
                f"keys {fold}",
                scores=lambda q, k: q @ _refolded(k).mT,
            ),
            Mutation(
                "batch_mixing",
                _S,
                f"keys and values {fold}",
                scores=lambda q, k: q @ _refolded(k).mT,
                context=lambda w, v: w @ _refolded(v),
            ),
        ]
    leak = c.spec.packed_leak
    if leak is not None and leak.shape[-1] == c.batch * c.tokens:
        # the batch packed into one sequence under the layer's own mask, which lets
        # queries see other sequences' keys (a call of one sequence is not packed: as is)
        def packed(q: T, k: T, hide: T = leak) -> T:
            s = q @ k.mT
            return s.masked_fill(hide, -torch.inf) if s.shape[-1] == hide.shape[-1] else s

        out.append(
            Mutation(
                "batch_mixing",
                _S,
                "the batch packed into one sequence under a mask that lets each query see "
                "keys of other sequences",
                flatten_batch=True,
                scores=packed,
            )
        )
    if c.spec.kind.cross and c.batch > 2:
        # a cross layer's memory of the batch in reverse order (DUSt3R's two views swapped
        # by ``flip(0)``; for two sequences the same as taking the other's)
        out.append(
            Mutation(
                "batch_mixing",
                _S,
                "keys and values taken from another sequence of the batch (the batch reversed)",
                qkv=lambda q, k, v: (q, k.flip(0), v.flip(0)),
            )
        )
    for what in ("keys", "keys and values"):
        out.append(
            Mutation(
                "batch_mixing",
                _S,
                f"{what} taken from another sequence of the batch",
                qkv=lambda q, k, v, w=what: (
                    q,
                    k.roll(1, dims=0),
                    v.roll(1, dims=0) if "values" in w else v,
                ),
            )
        )
    return out


def _refolded(t: T) -> T:
    """``(B, H, ...)`` folded (heads, batch) and read back as (batch, heads)."""
    return t.transpose(0, 1).reshape(t.shape)


# ------------------------------------------------------------------ missing_scale, wrong_scale


def named_scales(spec: Spec, tokens: int) -> list[tuple[float, str]]:
    """The factors people scale by instead of 1/sqrt(d_k), with their names."""
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
    if spec.declared_scale is not None:  # the textbook factor, where the layer declares another
        named.insert(0, (1.0 / math.sqrt(dk), f"1/sqrt(d_k) = 1/sqrt({dk})"))
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
    for v, text in named_scales(spec, tokens):
        if math.isclose(v, value, rel_tol=1e-3):
            return text
    short = f"{value:.4g}"  # a fitted 127.999 is 128
    return short if math.isclose(float(short), value, rel_tol=1e-4) else f"{value:.6g}"


def with_scale(m: Mutation, value: float, text: str) -> Mutation:
    """A scale mutation with a fitted factor (a factor nobody named)."""
    code = "missing_scale" if math.isclose(value, 1.0, rel_tol=1e-3) else "wrong_scale"
    return replace(
        m, code=code, scale=value, label=f"scaled by {text}", facts={"c": value, "name": text}
    )


@define(
    "missing_scale",
    expected=lambda s: (
        f"expected the scale the layer declares, {s.scale_source} = {s.scale:.4g}"
        if s.declared_scale is not None
        else f"expected scores / sqrt(d_k) with d_k = keys.shape[-1] = {s.head_dim} "
        f"(factor {s.scale:.4g})"
    ),
)
def _missing_scale(c: Context) -> list[Mutation]:
    if c.spec.simplified:  # the book's simplified attention has no scaling at all
        return []
    out = [
        Mutation("missing_scale", Stage.SCALED_SCORES, "no scaling", scale=1.0, facts={"c": 1.0})
    ]
    alibi = c.spec.position_bias
    if alibi is not None and not alibi.before_scale:
        # bias.baddbmm(q, k, beta=scale, alpha=1) for beta=1, alpha=scale: the factor
        # lands on the position bias, the scores go unscaled
        factor = c.spec.scale
        out.append(
            Mutation(
                "missing_scale",
                Stage.SCALED_SCORES,
                "no scaling of the scores, the scale applied to the position bias instead "
                "(baddbmm's beta and alpha swapped?)",
                scale=1.0,
                bias=lambda h, n: _scaled_bias(alibi.bias(h, n), factor),
                facts={"c": 1.0},
            )
        )
    return out


def _scaled_bias(bias, factor: float):
    return None if bias is None else bias * factor


def _wrong_scale_expected(s: Spec) -> str:
    if s.simplified:
        return "expected the raw scores: simplified attention (no trainable weights) is not scaled"
    if s.declared_scale is not None:
        return f"expected the scale the layer declares, {s.scale_source} = {s.scale:.4g}"
    per_head = " per head" if s.num_heads > 1 else ""
    return (
        f"expected 1/sqrt(d_k) = 1/sqrt({s.head_dim}) = {s.scale:.4g}, d_k being the keys' "
        f"last dimension{per_head}"
    )


def _wrong_scale_headline(mut: Mutation, s: Spec) -> str:
    said = f"{mut.stage.value}: scores scaled by {mut.facts.get('name')}"
    if s.declared_scale is not None:
        return f"{said} instead of the declared {s.scale_source}"
    return said if s.simplified else f"{said} instead of 1/sqrt(d_k)"


@define("wrong_scale", expected=_wrong_scale_expected, headline=_wrong_scale_headline)
def _wrong_scale(c: Context) -> list[Mutation]:
    note = " (simplified attention is not scaled)" if c.spec.simplified else ""
    return [
        Mutation(
            "wrong_scale",
            Stage.SCALED_SCORES,
            f"scaled by {text}{note}",
            scale=value,
            facts={"c": value, "name": text},
        )
        for value, text in named_scales(c.spec, c.tokens)
    ]
