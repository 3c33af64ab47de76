"""What was read of one attention layer: its core (the products, or a fused call) and its
structure (projections by role, heads, the layer's module, the mask). Filled by
:mod:`.structure` and :mod:`.features`; read by the binding and the probe."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .projections import Projection
from .record import ModuleCall, Op

__all__ = ["Core", "Structure"]

T = torch.Tensor


@dataclass
class Core:
    """One attention computation: a scores product and its context product, or one fused
    call. ``*_node`` are the operands as the computation used them."""

    q_node: int
    k_node: int
    v_node: int | None
    head_dim: int
    score: Op | None = None
    context: Op | None = None
    fused: Op | None = None


@dataclass
class Structure:
    """What one recorded call says about the layer. See the module docstring."""

    layer: str  # dotted module path of the attention layer; "" for the target itself
    call: ModuleCall | None  # its call in the record (None for the target itself)
    input_node: int | None  # the tensor its projections read
    roles: dict[str, list[Projection]]  # "q", "k", "v" -> projections, in head order
    shared: dict[str, str]  # role -> the role whose projection it shares (combined weights)
    out: Projection | None
    unused: list[tuple[str, nn.Module | T]]  # the layer's projection weights never used
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    cores: list[Core]
    causal: str | None = None  # the evidence, with its line
    notes: list[str] = field(default_factory=list)
    #: ops inside the layer between its input and what the projections read (a norm the
    #: layer applies first): the stages are then checked from what the projections read
    pre: list[Op] = field(default_factory=list)
    #: "queries"/"keys" -> (what, line) where something position-dependent turns them (a
    #: rotary embedding, read back by the probe, which refuses what is not a rotation)
    rotary: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    #: "queries"/"keys" -> (what, line) where a norm is applied to them (read by the probe)
    qk_norm: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    #: the sliding window its mask shows (keys a query sees, itself included), with its line
    window: tuple[int, str | None] | None = None
    #: where ``window`` is a bidirectional local window (keys on either side, not causal):
    #: what shows it, with its line
    local: str | None = None
    #: cross-attention: the line where keys and values are projected from another sequence
    cross: str | None = None
    #: a position bias (ALiBi) added to the scores, as seen (see :class:`.features.BiasSeen`)
    bias: object | None = None
    #: features per role, all heads together ("q", "k", "v"), as the computation reads them
    widths: dict[str, int] = field(default_factory=dict)
    #: the columns of one combined weight that make the queries, keys and values, where it
    #: makes more (a parallel block's feed-forward input): ``(start, end)``
    block: tuple[int, int] | None = None
    #: the line where the scores go through a tanh (logit soft-capping, Gemma 2)
    softcap: str | None = None
    #: one combined projection: the columns each role ("q", "k", "v") reads, heads in
    #: order, as the computation's own cuts (reshapes, splits, slices) take them; None where
    #: they could not be traced to whole heads of one partition of its output
    cuts: dict[str, T] | None = None
    #: (what, line) where the keys and values are written into a cache the scores read
    #: whole, more keys than the sequence has (a KV cache the forward requires)
    cache: tuple[str, str | None] | None = None
    #: (what, line) of operations on the queries, keys, values or scores that the reference
    #: does not model (unit-length normalisation, a varying factor on the scores, rows
    #: joined to the keys): where no reading and no known mistake explains the output, the
    #: layer is refused naming the first, not given a verdict
    unmodelled: list[tuple[str, str | None]] = field(default_factory=list)
    #: (op index, what, line) of a norm applied to the merged context before the output
    #: projection (Kosmos-2's ``inner_attn_ln``, BitNet's ``attn_sub_norm``): read by the
    #: probe, which refuses it when it is not a plain norm
    out_norm: tuple[int, str, str | None] | None = None
    #: op index -> (role, factor, line) of a constant the queries or keys are multiplied
    #: by on their way to the scores (a scale folded in early, Falcon-H1's muP
    #: ``key_multiplier``); the probe takes one that is no power of the layer's sizes as
    #: part of the layer's scale (see :meth:`.probe.ModuleProbe._multipliers`)
    qk_factors: dict[int, tuple[str, float, str | None]] = field(default_factory=dict)
    #: the constants the scores are multiplied by between their product and the softmax
    #: (a factor on the queries undone there: BEiT-3's and BEATs' ``q / alpha``, then the
    #: scores ``* alpha`` after their max is taken off)
    score_factors: list[float] = field(default_factory=list)
    #: the projections' ops that ``roles`` does not list: one weight applied again to
    #: another sequence of the batch (a loop over the sequences), read as the one it is
    repeats: set[int] = field(default_factory=set)
    #: a batch packed into one sequence whose mask lets queries see another sequence's
    #: keys: the cells it hides, ``(batch * tokens, batch * tokens)`` for the recorded
    #: probe's sizes, with its line (the mistake ``batch_mixing``, which the judge
    #: reproduces with this very mask)
    packed_leak: tuple[T, str | None] | None = None

    @property
    def projection_ops(self) -> set[int]:
        """Every op that applied a projection (where the path from the input ends)."""
        return {p.op.index for ps in self.roles.values() for p in ps} | self.repeats

    @property
    def weightless(self) -> bool:
        return not any(self.roles.values())

    def describe(self) -> str:
        """``queries/keys/values: attn.c_attn; out: attn.c_proj``: what made each role."""
        bits = []
        for role, label in (("q", "queries"), ("k", "keys"), ("v", "values")):
            projs = self.roles.get(role) or []
            if not projs or role in self.shared:
                continue
            with_it = [
                lab for r, lab in (("k", "keys"), ("v", "values")) if self.shared.get(r) == role
            ]
            bits.append(f"{'/'.join([label, *with_it])}: {_owners(projs)}")
        if self.out is not None:
            bits.append(f"out: {_owners([self.out])}")
        return "; ".join(bits)


def _owners(projs: list[Projection]) -> str:
    """The parameters a role read, named by their module where they have one (``W_query``
    for ``W_query.weight`` and ``W_query.bias``)."""
    names = []
    for p in projs:
        for n in p.params:
            owner, _, last = n.rpartition(".")
            name = owner if owner and last in ("weight", "bias") else n
            if name not in names:
                names.append(name)
    return ", ".join(names) or "a projection"
