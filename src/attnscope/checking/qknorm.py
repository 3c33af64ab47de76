"""QK norm (RMSNorm or LayerNorm on queries and keys), read back from the computation.

The gain (and a LayerNorm's shift) is what the layer multiplies (adds) on the queries' way
to the scores: a tensor made from its parameters, whatever it is called (``q_norm.weight``,
``1 + weight`` as Gemma does, a ``(heads, head_dim)`` table as Cohere's). Which norm, over
what (each head, or the whole projection before the heads are split), and in which order
with the rotation are hypotheses; the one that reproduces the tensor the scores were made
from, exactly, is the layer's. See :func:`read_side`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .rotary import Tables, fit_tables

__all__ = [
    "QKNorm",
    "ContextNorm",
    "NormSide",
    "normalise",
    "read_side",
    "read_context_norm",
    "gains_on_path",
    "eps_on_path",
]

T = torch.Tensor
SCOPES = ("per-head", "full")
KINDS = ("rms", "layer")


def normalise(t: T, kind: str, eps: float) -> T:
    """Over the last axis: ``t / rms(t)`` (RMSNorm) or ``(t - mean) / std`` (LayerNorm)."""
    if kind == "layer":
        t = t - t.mean(-1, keepdim=True)
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def _normed_rows(t: T, kind: str, eps: float, gain: T | None, bias: T | None) -> T:
    """Over the last axis, ``t`` normed then scaled by ``gain`` and shifted by ``bias`` (each
    as wide as that axis; ``None``, or another width, leaves that part out)."""
    t = normalise(t, kind, eps)
    t = t if gain is None or gain.numel() != t.shape[-1] else t * gain.reshape(-1)
    return t if bias is None or bias.numel() != t.shape[-1] else t + bias.reshape(-1)


def _merge(t: T) -> T:
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def _split(t: T, h: int) -> T:
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).transpose(1, 2)


def _affine(t: T, gain: T | None, bias: T | None, heads: int) -> T:
    """Gain and shift on ``(B, H, T, D)``: a ``(D,)`` one per feature, a ``(H, D)`` or
    ``(H*D,)`` one per head and feature."""
    for v, op in ((gain, "mul"), (bias, "add")):
        if v is None:
            continue
        d = t.shape[-1]
        if v.numel() == d:
            v = v.reshape(d)
        else:  # per head; a key/value head's gain serves its group of repeated heads
            m = v.numel() // d
            v = v.reshape(m, 1, d).repeat_interleave(heads // m, dim=0)
        t = t * v if op == "mul" else t + v
    return t


@dataclass(eq=False)
class QKNorm:
    """The reference's QK norm: ``scope`` per-head or full, ``kind`` rms or layer, the
    gains and shifts of each side (``None``: 1 and 0), ``eps``."""

    scope: str
    kind: str
    q_gain: T | None = None
    q_bias: T | None = None
    k_gain: T | None = None
    k_bias: T | None = None
    eps: float = 1e-6

    def apply(self, role: str, t: T) -> T:
        """``(B, H, T, D)`` queries (``role`` "q") or keys, normed."""
        gain, bias = (self.q_gain, self.q_bias) if role == "q" else (self.k_gain, self.k_bias)
        h = t.shape[1]
        if self.scope == "full":
            normed = _split(normalise(_merge(t), self.kind, self.eps), h)
        else:
            normed = normalise(t, self.kind, self.eps)
        return _affine(normed, gain, bias, h)

    def apply_whole(self, role: str, flat: T) -> T:
        """A norm over the whole projection (``scope`` full) on ``(B, T, H*D)`` before the
        heads are cut: where they are cut wrongly, the norm still saw each token's row."""
        gain, bias = (self.q_gain, self.q_bias) if role == "q" else (self.k_gain, self.k_bias)
        return _normed_rows(flat, self.kind, self.eps, gain, bias)


@dataclass(eq=False)
class ContextNorm:
    """A norm over the merged heads before the output projection (a sub-LayerNorm:
    Kosmos-2's ``inner_attn_ln``, BitNet's ``attn_sub_norm``): ``kind`` rms or layer, the
    gain and shift ``(d,)`` (``None``: 1 and 0), ``eps``."""

    kind: str
    gain: T | None = None
    bias: T | None = None
    eps: float = 1e-6

    def apply(self, t: T) -> T:
        """``(..., d)`` merged heads, normed."""
        return _normed_rows(t, self.kind, self.eps, self.gain, self.bias)


def read_context_norm(
    inputs: list[T], u: T, gains: list[tuple[T | None, T | None]], eps: float
) -> ContextNorm | None:
    """The norm that makes ``u`` ``(N, d)`` from one of ``inputs`` (each ``(N, d)``, the
    tensors it may have been made from, nearest first), or None when none is exact."""
    for c in inputs:
        for gain, bias in gains:
            for kind in KINDS:
                norm = ContextNorm(kind, gain, bias, eps)
                try:
                    if _exact(norm.apply(c), u):
                        return norm
                except RuntimeError:  # a gain of another width
                    continue
    return None


@dataclass
class NormSide:
    """How one side (queries or keys) reached the scores: its tables after the norm (or
    without one), and the norm found."""

    tables: Tables
    normed: bool = False
    scope: str | None = None
    kind: str | None = None
    gain: T | None = None
    bias: T | None = None
    misplaced: bool = False  # normed after the rotation


def read_side(
    p: T,
    u: T,
    gains: list[tuple[T | None, T | None]],
    eps: float,
    rotations: list[Tables] = (),
    cut: tuple[T, object] | None = None,
) -> NormSide | None:
    """How ``u`` (the operand of the scores, ``(B, H, T, D)``) was made from the projected
    heads ``p``: a rotation (or nothing) alone, or a norm with one of ``gains`` then a
    rotation, or a rotation then the norm. None when no hypothesis is exact.

    ``rotations`` are rotations seen on the way (tensors between the projection and ``u``
    that are ``p`` turned, :func:`.rotary.fit_tables`): a norm applied after one of them
    (any norm, a LayerNorm's mean included, which does not commute with a rotation) is
    the mistake ``qk_norm_misplaced`` when it reproduces ``u`` exactly.

    A linear fit also "explains" a gain folded into the tables (which is no rotation), so
    hypotheses are ranked: a rotation (or nothing), then the norm after the rotation, then
    tables laid out for the other pairing (the mistake ``rope_pairing``).

    ``cut``: ``(flat, split)``, the projection ``(B, T, H*D)`` and how ``p`` was cut from
    it, where that is not the usual split (heads cut wrongly): a norm over the whole
    projection is then taken before that cut, as the layer takes it."""
    found: list[tuple[int, NormSide]] = []

    def consider(side: NormSide) -> None:
        rank = _rank(side.tables)
        if rank is not None:
            found.append((rank + (1 if side.misplaced else 0), side))

    plain = fit_tables(p, u, by_head=True)  # tables indexed by the head read here only
    if plain is not None:
        consider(NormSide(plain))
    h = p.shape[1]
    for gain, bias in gains:
        for scope in SCOPES:
            for kind in KINDS:
                try:
                    if scope == "full" and cut is not None:
                        flat, split_as = cut
                        t = fit_tables(split_as(_normed_rows(flat, kind, eps, gain, bias)), u)
                        if t is not None:
                            consider(NormSide(t, True, scope, kind, gain, bias))
                        continue
                    if scope == "full":
                        normed = _split(normalise(_merge(p), kind, eps), h)
                    else:
                        normed = normalise(p, kind, eps)
                    t = fit_tables(_affine(normed, gain, bias, h), u)
                    if t is not None:
                        consider(NormSide(t, True, scope, kind, gain, bias))
                    if scope == "per-head" and _invertible(gain):
                        # rotated first, then normed: a per-head norm keeps the rotation's
                        # length, so undoing the gain leaves the rotation of the normed heads
                        un = u if bias is None else _affine(u, None, -bias, h)
                        un = un / _affine(torch.ones_like(un[:1, :, :1]), gain, None, h)
                        t = fit_tables(normalise(p, kind, eps), un)
                        if t is not None and t.turns:
                            consider(NormSide(t, True, scope, kind, gain, bias, misplaced=True))
                    for t in rotations:
                        v = t.apply(p)
                        if scope == "full":
                            after = _split(normalise(_merge(v), kind, eps), h)
                        else:
                            after = normalise(v, kind, eps)
                        fit = _affine(after, gain, bias, h)
                        # a factor folded into the operand after the norm (queries divided
                        # by sqrt(d) before the product: Equinox, JAX ports)
                        factor = float((fit * u).sum() / (fit * fit).sum().clamp_min(1e-300))
                        if _exact(fit * factor, u):
                            if abs(factor - 1.0) > 1e-9:
                                t = dataclasses.replace(
                                    t,
                                    cos=t.cos * factor,
                                    sin=t.sin * factor,
                                    scale=t.scale * factor,
                                )
                            consider(NormSide(t, True, scope, kind, gain, bias, misplaced=True))
                except RuntimeError:  # a gain of another width than these heads
                    continue
    if not found:
        return None
    return min(found, key=lambda f: f[0])[1]


def _exact(fit: T, u: T) -> bool:
    big = max(u.abs().amax().item(), 1e-12)
    return fit.shape == u.shape and (fit - u).abs().amax().item() <= 1e-4 * big


def _rank(t: Tables) -> int | None:
    """0 for a rotation or none, 2 for tables laid out for the other pairing, None else."""
    if not t.turns or t.is_rotation():
        return 0
    return 2 if t.mismatched_layout() else None


def _invertible(gain: T | None) -> bool:
    return gain is None or bool((gain.abs() > 1e-6).all())


def gains_on_path(ops, graph, path: list, widths: set[int]) -> list[tuple[T | None, T | None]]:
    """Gains (and shifts) the path multiplies (adds) by a tensor made from parameters,
    ``widths`` wide in all: a norm's affine part, as candidates (with none first)."""
    muls, adds = [], []
    norm_gains, norm_shifts = [], []
    for op in path:
        if op.name in ("layer_norm", "rms_norm"):  # F.layer_norm(x, shape, weight, bias, eps)
            args = list(op.call_args) + [None] * 5
            w = op.call_kwargs.get("weight", args[2])
            b = op.call_kwargs.get("bias", args[3] if op.name == "layer_norm" else None)
            if isinstance(w, T):
                muls.append(w.detach().double())
                norm_gains.append(muls[-1].flatten())
            if isinstance(b, T):
                adds.append(b.detach().double())
                norm_shifts.append(adds[-1].flatten())
        if op.name in ("mul", "__mul__", "__rmul__", "mul_", "add", "__add__", "__radd__", "add_"):
            for a in op.args:
                t = ops[a].output
                if graph.param[a] and not graph.tainted[a] and t.numel() in widths:
                    (muls if "mul" in op.name else adds).append(t.detach().double().flatten())
    # one norm per head (StableLM's ModuleList of LayerNorms): their gains side by side
    for parts, store in ((norm_gains, muls), (norm_shifts, adds)):
        if len(parts) > 1 and len({p.numel() for p in parts}) == 1:
            joined = torch.cat(parts)
            if joined.numel() in widths:
                store.insert(0, joined)
    out: list[tuple[T | None, T | None]] = [(g, b) for g in muls for b in adds] if adds else []
    out += [(g, None) for g in muls] + [(None, None)]
    return out


def eps_on_path(ops, path: list) -> float:
    """The epsilon a norm on the path adds under its square root (1e-6 where none is read;
    none for ``F.normalize``, whose clamp of the norm at 1e-12 leaves any real vector be)."""
    for op in path:
        if op.name in ("layer_norm", "rms_norm"):
            args = list(op.call_args) + [None] * 5
            eps = op.call_kwargs.get("eps", args[4] if op.name == "layer_norm" else args[3])
            if isinstance(eps, float):
                return eps
        if op.name == "normalize":  # F.normalize clamps the norm at 1e-12: no epsilon
            return 0.0
        if op.name == "rsqrt" and op.args:
            inner = ops[op.args[0]]
            for v in list(inner.call_args) + list(inner.call_kwargs.values()):
                if isinstance(v, float) and 0 < v < 1e-2:
                    return v
    return 1e-6
