"""Judge recorded calls against the reference: correct, or the first stage that goes wrong.

Given the target's calls (input, output, recorded ops) and the readings of its weights:

1. If one reading of the weights reproduces the outputs, the implementation is correct,
   whatever its style; each stage is reported where it was seen. A probe at large
   magnitude then looks for a softmax that overflows.
2. Otherwise the reference is re-run with each known mistake (:mod:`.reference`); the
   earliest-stage mistake that reproduces the output is the diagnosis.
3. Where none does, the first stage whose own recorded tensor, put in place of the
   reference, reproduces the output is named, with the code its error suggests; failing
   that, the first stage nowhere among the recorded tensors, with ``other``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..errors import AttnScopeError
from ..stages import Dims, Kind, Stage, stages_for_kind
from .compare import Found, close, find_stage
from .features import Unsupported
from .mistakes import MISTAKES, Context, Evidence, catalogue, recognise
from .mistakes.scores import describe_scale, with_scale
from .record import Op, Recorder, SdpaCall
from .reference import NONE, Mutation, Spec, Weights, pipeline, project
from .report import CheckReport, Failure, StageCheck

__all__ = ["Call", "Judge", "LARGE", "SHORT"]

LARGE = 60.0  # large-magnitude probe: float32 exp overflows past scores of ~88
SHORT = 16  # probes longer than this are diagnosed on a short probe first

_Invoke = Callable[[torch.Tensor], tuple[torch.Tensor | None, str | None]]


@dataclass
class Call:
    """One call of the target: the float64 input in reference layout and what came back."""

    x: torch.Tensor  # (B, T, d) float64; B = 1 for an unbatched call
    out: torch.Tensor  # (B, T, d_out) float64
    batched: bool
    ops: list[Op] = field(default_factory=list)
    sdpa_ops: list[Op] = field(default_factory=list)
    fused: list[SdpaCall] = field(default_factory=list)  # the fused calls, as made
    probe: torch.Tensor | None = None  # what the target was given, where ``x`` differs
    record: Recorder | None = field(default=None, repr=False)  # the dataflow of the call
    #: cross-attention: the other sequence as its key/value projections read it, float64
    context: torch.Tensor | None = None
    #: cross-attention whose key/value projections read, instead, a transform of the
    #: queries' own input other than what the query projection reads (a block that hands
    #: its layer ``norm(q)`` where ``norm(context)`` belongs): that tensor, float64
    kv_own: torch.Tensor | None = None

    @property
    def given(self) -> torch.Tensor:
        """The input as the target was given it, ``(B, T, d)`` float64 (``x`` is what the
        projections read: the same, unless the layer transforms its input first)."""
        return self.x if self.probe is None else self.probe


#: the stages only some layers have (a QK norm, a rotation, a position bias): shown in a
#: report where the layer's reference makes them
_MODERN = (
    Stage.NORMED_QUERIES,
    Stage.NORMED_KEYS,
    Stage.ROTATED_QUERIES,
    Stage.ROTATED_KEYS,
    Stage.BIASED_SCORES,
)


def _seen(
    found: Found | None, stage: Stage, per_head: bool, explained: bool = True, scale: float = 1.0
) -> str:
    if found is None:
        unseen = "not seen as a tensor (fused or computed inline)"
        # only where the whole output is accounted for may an unseen stage be vouched for
        return unseen + ("; consistent with the output" if explained else "")
    bits = [f"matches the reference: {found.op.name}"]
    if found.location:
        bits.append(f"at {found.location}")
    if found.layout:
        bits.append(f"(layout: {found.layout})")
    if abs(found.factor - 1) > 1e-3:
        if abs(found.factor * scale - 1) < 1e-3:  # masked before scaling (the book's order)
            bits.append(f"(times {found.factor:.4g}: masked before the scale is applied)")
        else:
            bits.append(f"(scaled by {found.factor:.4g}: the scale is folded in earlier)")
    if per_head and stage in (
        Stage.QUERIES,
        Stage.KEYS,
        Stage.VALUES,
        Stage.SCORES,
        Stage.SCALED_SCORES,
        Stage.MASKED_SCORES,
        Stage.WEIGHTS,
        Stage.CONTEXT,
    ):
        bits.append("for every head")
    return " ".join(bits)


def _first_sentence(message: str) -> str:
    """Up to the first ". " that ends a sentence ("query . key" does not)."""
    return re.split(r"\. (?=[A-Z])", message, maxsplit=1)[0]


class Judge:
    """Walks one target's calls through the reference and writes the report.

    Args:
        target: the target as the user named it (for the report).
        kind, kind_reason: the kind checked and why it was chosen.
        notes: remarks gathered while probing; the judge adds its own.
        calls: at least one call; ``calls[0]`` is the one whose recording is reported.
        invoke: runs the target on a float32 input, ``(out, None)`` or ``(None, error)``.
        reprobe: a short probe of the same target (for fast diagnosis), or ``None``.
        recorder: makes the recorder for a call on a given input.
        reference_input: where the projections read a transform of the input (a norm
            inside the layer), that transform's tensor in a call's record.
        stage_of: the stage a recorded op belongs to (to say where NaN first appears).
    """

    def __init__(
        self,
        *,
        target: str,
        kind: Kind,
        kind_reason: str,
        notes: list[str],
        calls: list[Call],
        invoke: _Invoke | None = None,
        reprobe: Callable[[], list[Call] | None] | None = None,
        recorder: Callable[[torch.Tensor], Recorder] = lambda x: Recorder(),
        reference_input: Callable[[Recorder, torch.Tensor], torch.Tensor] | None = None,
        stage_of: Callable[[Call, Op], Stage | None] | None = None,
    ):
        self.target, self.kind, self.kind_reason, self.notes = (
            target,
            Kind.of(kind),
            kind_reason,
            notes,
        )
        self.calls, self.invoke, self.reprobe = calls, invoke, reprobe
        self.recorder, self.reference_input = recorder, reference_input
        self.stage_of = stage_of
        #: the scores' line names the keys before the queries (a tie-break between two
        #: readings of the same numbers: see :func:`.structure.keys_named_first`)
        self.keys_named_first = False
        self.spec: Spec | None = None
        self.w: Weights | None = None
        #: (stage, message, location) when the target's output is not deterministic
        self.varies: tuple[Stage, str, str | None] | None = None
        #: (what, line) of operations seen in the computation that the reference does not
        #: model (see :attr:`.layer.Structure.unmodelled`); a rotation read where the
        #: layer's rotary is
        self.unmodelled: list[tuple[str, str | None]] = []
        #: a longer length the layer is also held to, once correct (None: not tried)
        self.longer: int | None = None
        self.rotary_at: str | None = None

    def _stage_list(self) -> list[Stage]:
        stages = list(stages_for_kind(self.kind))
        if self.spec is not None and self.spec.window and Stage.MASKED_SCORES not in stages:
            stages.insert(stages.index(Stage.WEIGHTS), Stage.MASKED_SCORES)  # a local window
        if self.spec is not None and self.spec.has_out and Stage.OUTPUT not in stages:
            stages.append(Stage.OUTPUT)
        return stages

    def _shown_stages(self, refs: dict[Stage, torch.Tensor]) -> list[Stage]:
        """The stages a report walks: the kind's, and the modern ones the reference of this
        layer has (normed, rotated, biased), in pipeline order."""
        modern = [st for st in _MODERN if st in refs]
        return sorted([*self._stage_list(), *modern], key=lambda st: st.order)

    def _report(
        self,
        failure: Failure | None,
        found: dict[Stage, Found | None],
        refs: dict[Stage, torch.Tensor],
        dims: Dims,
        user_tensor: torch.Tensor | None = None,
        user_full: torch.Tensor | None = None,
        explained: bool = True,
    ) -> CheckReport:
        checks: list[StageCheck] = []
        per_head = self.spec is not None and self.spec.num_heads > 1
        order = self._shown_stages(refs)
        if failure is not None and failure.stage not in order:
            order = sorted([*order, failure.stage], key=lambda st: st.order)
        for stage in order:
            f = found.get(stage)
            predicted = dims.shape_of(stage) if stage is not Stage.QUERY else (dims.d_in,)
            actual = tuple(f.op.output.shape) if f is not None else None
            ref = refs.get(stage)
            ref0 = (
                ref[0] if ref is not None and ref.dim() >= 2 and stage is not Stage.QUERY else ref
            )
            if failure is not None and stage is failure.stage:
                observed = user_tensor
                implied = user_full.shape if user_full is not None else None
                checks.append(
                    StageCheck(
                        stage,
                        False,
                        _first_sentence(failure.message),
                        predicted,
                        tuple(implied) if implied is not None else actual,
                        failure.location,
                        ref0,
                        observed,
                    )
                )
                break
            checks.append(
                StageCheck(
                    stage,
                    True,
                    _seen(f, stage, per_head, explained, self.spec.scale if self.spec else 1.0),
                    predicted,
                    actual,
                    f.location if f else None,
                    ref0,
                    None,
                )
            )
        return CheckReport(
            ok=failure is None,
            kind=self.kind.name,
            target=self.target,
            first_failure=failure,
            checks=checks,
            kind_reason=self.kind_reason,
            notes=self.notes,
        )

    def run(self, options: list[tuple[Weights | None, Spec]]) -> CheckReport:
        """The report: correct under one reading of the weights, or the first failure."""
        # each reading's output on every call; a reading the reference cannot run (widths
        # that do not compose) is none
        ran = []
        for w, spec in options:
            try:
                outs = [pipeline(c.x, spec, w, context=c.context)["output"] for c in self.calls]
            except RuntimeError:
                continue
            ran.append(
                ((w, spec), [close(c.out, o) for c, o in zip(self.calls, outs, strict=True)])
            )
        options = [o for o, _ in ran]
        matches = [m for _, m in ran]
        if not options:
            raise Unsupported(
                "not supported yet: the projections read from the computation do not fit "
                "together as one attention (widths that do not compose: heads written one at "
                "a time into a tensor of the layer's own, or cut in a way not read?)"
            )
        if self.varies is not None:  # random in eval mode: nothing can match reliably
            stage, message, where = self.varies
            self.w, self.spec = max(options, key=lambda o: self._confirmations(*o))
            found, refs = self._observe(self.calls[0])
            return self._report(
                Failure(stage, "other", message, where), found, refs, self._dims(self.calls[0])
            )
        for (w, spec), ok in zip(options, matches, strict=True):
            if all(ok):
                self.w, self.spec = w, spec
                return self._correct_or_unstable()
        for (w, spec), ok in zip(options, matches, strict=True):
            batched = [m for m, c in zip(ok, self.calls, strict=True) if c.batched]
            if batched and all(batched):
                # right on every batched call, and another result for the same sequence
                # alone: its (tokens, d) input means something else (HF layers take
                # (batch, tokens, d) only); checked batched, as one that raises on it is
                self.calls = [c for c in self.calls if c.batched]
                self.notes.append(
                    "accepts only batched input (unbatched input gives another result than "
                    "the same sequence in a batch: its (tokens, d) input means something else)"
                )
                self.w, self.spec = w, spec
                return self._correct_or_unstable()
        # no reading reproduces the output: pick the one the recorded tensors confirm best;
        # among readings confirmed alike (a combined weight's keys and values exchanged),
        # the first a known mistake explains
        confirmed = [self._confirmations(*o) for o in options]
        best = [o for o, c in zip(options, confirmed, strict=True) if c == max(confirmed)]
        chosen = best[0]
        if len(best) > 1:
            for option in best:
                self.w, self.spec = option
                if self._explain_quickly() is not None:
                    chosen = option
                    break
        self.w, self.spec = chosen
        return self._diagnose()

    def _confirmations(self, w, spec) -> tuple[int, int]:
        """How many of a reading's queries, keys and values the recorded tensors show; then,
        to tell apart readings that show all three (a combined weight's keys and values
        exchanged shows both), how many of the stages made from them (normed, rotated,
        scores)."""
        call = self.calls[0]
        ref = pipeline(call.x, spec, w, context=call.context)
        ops = call.ops + call.sdpa_ops

        def shown(stages) -> int:
            return sum(
                stage.value in ref
                and find_stage(ops, stage, ref[stage.value], batched=call.batched) is not None
                for stage in stages
            )

        return shown((Stage.QUERIES, Stage.KEYS, Stage.VALUES)), shown((*_MODERN[:4], Stage.SCORES))

    def _observe(self, call: Call) -> tuple[dict[Stage, Found | None], dict[Stage, torch.Tensor]]:
        ref = pipeline(call.x, self.spec, self.w, context=call.context)
        ops = call.ops + call.sdpa_ops
        found: dict[Stage, Found | None] = {}
        refs: dict[Stage, torch.Tensor] = {}
        for stage in [*self._stage_list(), *_MODERN]:
            t = ref.get(stage.value)
            if t is None:
                continue
            refs[stage] = t
            found[stage] = find_stage(
                ops,
                stage,
                t,
                batched=call.batched,
                spec_scale=self.spec.scale,
                causal=self.spec.causal,
            )
        return found, refs

    def _dims(self, call: Call) -> Dims:
        s = self.spec
        return Dims(
            tokens=call.x.shape[1],
            d_in=s.d_in,
            d_out=s.d_out,
            batch=call.x.shape[0] if call.batched else None,
            num_heads=s.num_heads if s.multihead else None,
        )

    def _correct_or_unstable(self) -> CheckReport:
        call = self.calls[0]
        found, refs = self._observe(call)
        failure = self._large_probe()
        if failure is None:
            self._longer_probe()
        return self._report(failure, found, refs, self._dims(call))

    def _longer_probe(self) -> None:
        """Correct at the probe's length: is it still the reading's attention on a longer
        input? What changes past some length (queries scaled by log(position) past the
        trained length, a rotation rescaled past it) is not modelled: refused, never passed."""
        if self._at_longer() is not False:
            return
        tokens, n = self.calls[0].x.shape[1], self.longer
        if self.spec.rope is not None:
            why = (
                f"the rotary position embedding read at {tokens} tokens does not hold at {n} "
                "(positions on a 2-D grid of patches, frequencies rescaled past a trained "
                "length?), or queries scaled by log(position) past it, or a mask of another "
                "pattern"
            )
        else:
            why = (
                f"at {tokens} tokens it computes the attention read, at {n} something else "
                "(queries scaled by log(position) past a trained length, a mask of another "
                "pattern?)"
            )
        raise Unsupported(f"not supported yet: what changes with the sequence's length: {why}")

    def _at_longer(self, mut: Mutation | None = None) -> bool | None:
        """Whether the layer computes the reading (with ``mut``, if given) on an input of
        :attr:`longer` tokens too; None where that cannot be tried (no longer length, a
        cross layer, an input laid out for the probe's length)."""
        call, n = self.calls[0], self.longer
        if n is None or call.context is not None or n <= call.x.shape[1]:
            return None
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(call.x.shape[0], n, call.given.shape[-1], generator=gen)
        if not call.batched:
            x = x[:1]  # the one sequence an unbatched call takes
        x_in = x if call.batched else x[0]
        rec = self.recorder(x_in)
        try:
            with rec:
                out, err = self.invoke(x_in)
        except RuntimeError:  # an input laid out for the probe's length
            return None
        if err is not None or not isinstance(out, torch.Tensor):
            return None  # a longer input it does not take
        try:
            if self.reference_input is not None:
                x = self.reference_input(rec, x_in).reshape(*x.shape[:-1], -1)
            ref = pipeline(x.double(), self.spec, self.w, mut or NONE)["output"]
        except (RuntimeError, AttnScopeError):
            return None  # the reading does not extend to this length (a grid of tokens)
        out = out.double() if call.batched else out.double().unsqueeze(0)
        return out.shape != ref.shape or close(out, ref)

    def _large_probe(self) -> Failure | None:
        """Correct on normal inputs: does it stay finite where torch.softmax does?"""
        call = self.calls[0]
        if call.context is not None:
            return None  # cross-attention: its other sequence would have to grow too
        x = (call.given * LARGE).float()
        x_in = x if call.batched else x[0]
        rec = self.recorder(x_in)
        with rec:
            out, err = self.invoke(x_in)
        if err is not None:
            return None
        if self.reference_input is not None:  # the projections read a transform of x
            x = self.reference_input(rec, x_in).reshape(x.shape).float()
        ref = pipeline(x.double(), self.spec, self.w)["output"]
        bad = ~torch.isfinite(out.double())
        if not bad.any() or (~torch.isfinite(ref)).any():
            return None
        exp_ops = [
            op
            for op in rec.ops
            if op.name in ("exp", "exp2", "pow", "__pow__", "__rpow__")
            and not torch.isfinite(op.output).all()
        ]
        where = exp_ops[0].location if exp_ops else None
        if exp_ops:
            msg = (
                f"weights: the softmax overflows: exp() of scores up to "
                f"{self._max_logit(x):.3g} gives inf, and inf/inf is NaN ({int(bad.sum())} "
                "output entries not finite) at large input magnitude, where torch.softmax "
                "stays finite. Subtract each row's maximum before exp, or use torch.softmax"
            )
            if where:
                msg += f". Look at {where}"
            return Failure(Stage.WEIGHTS, "unstable_softmax", msg, where)
        # No overflowing exp: the values are right; the arithmetic loses range. Say so, but
        # a correct computation is not called wrong.
        self.notes.append(
            f"at {LARGE:g}x the input magnitude {int(bad.sum())} output entries become inf or "
            "NaN where the reference stays finite (no exp overflow was seen)"
        )
        return None

    def _max_logit(self, x: torch.Tensor) -> float:
        stages = pipeline(x.double(), self.spec, self.w)
        return stages["scaled_scores"].abs().max().item()

    def _diagnose(self) -> CheckReport:
        call = self.calls[0]
        found, refs = self._observe(call)
        hit = self._explain_quickly()
        if hit is not None:
            mut, stages = hit
            if mut.stage is Stage.SCALED_SCORES:
                # queries and keys of unit length (cosine attention) are scaled by design
                # by a temperature of their own: a scale then is no mistake to name
                self._refuse_unmodelled(only="cosine")
            user = stages.get(mut.stage.value)
            user0 = user[0] if user is not None and user.dim() >= 2 else user
            where = self._where(mut, stages, call)
            failure = Failure(mut.stage, mut.code, self._message(mut, where), where)
            return self._report(failure, found, refs, self._dims(call), user0, user)
        self._refuse_unmodelled()
        self._check_shape(call)
        if not bool(torch.isfinite(call.out).all()):
            failure = self._non_finite(call)
            return self._report(failure, found, refs, self._dims(call), explained=False)
        failure, user0 = self._fallback(found, refs, call)
        return self._report(failure, found, refs, self._dims(call), user0, explained=False)

    def _refuse_unmodelled(self, only: str | None = None) -> None:
        """No known mistake explains the output, and the computation does something the
        reference does not model: that, not a verdict (which would blame correct code for a
        feature the checker cannot follow). ``only``: the operations whose description
        starts so."""
        seen = [(w, at) for w, at in self.unmodelled if only is None or w.startswith(only)]
        if only is not None:
            if seen:
                what, where = seen[0]
                raise Unsupported(f"not supported yet: {what}" + (f" at {where}" if where else ""))
            return
        rope = self.spec.rope if self.spec is not None else None
        if rope is not None and not rope.linear:
            seen.insert(
                0,
                (
                    "rotary position embedding whose angles are not position x frequency "
                    "(a 2-D rotary over an image's rows and columns, or tokens left unrotated?)",
                    self.rotary_at,
                ),
            )
        if seen:
            what, where = seen[0]
            raise Unsupported(f"not supported yet: {what}" + (f" at {where}" if where else ""))

    def _check_shape(self, call: Call) -> None:
        """An output of another shape that no known mistake explains cannot be judged."""
        ref = pipeline(call.x, self.spec, self.w, context=call.context)["output"]
        if call.out.shape == ref.shape:
            return
        want, got = ref.shape, call.out.shape
        if not call.batched:
            want, got = want[1:], got[1:]
        raise AttnScopeError(
            f"{self.target}: expected an output of shape ({', '.join(map(str, want))}) "
            f"(one row per token, {ref.shape[-1]} features), got ({', '.join(map(str, got))})"
        )

    def _non_finite(self, call: Call) -> Failure:
        """NaN or inf in the output that no known mistake explains: the stage where the first
        non-finite value appears, and what it is."""
        out = call.out
        what = "NaN" if bool(torch.isnan(out).any()) else "inf"
        count = int((~torch.isfinite(out)).sum())
        first = None
        for op in call.ops:
            if op.leaf is not None or not op.comparable or op.stale:
                continue
            t = op.output
            square = t.dim() >= 2 and t.shape[-1] == t.shape[-2]
            # -inf is how masks hide keys: only NaN, +inf, or -inf outside a score matrix
            if bool(torch.isnan(t).any() | torch.isposinf(t).any()) or (
                not square and bool(torch.isneginf(t).any())
            ):
                first = op
                break
        stage = self.stage_of(call, first) if first is not None and self.stage_of else None
        stage = stage or Stage.OUTPUT
        code = "other"
        if first is not None and first.name in ("exp", "exp2", "pow", "__pow__", "__rpow__"):
            stage, code = Stage.WEIGHTS, "unstable_softmax"
        msg = f"{stage.value}: the output holds {what} ({count} of {out.numel()} entries)"
        if first is not None:
            kind = "NaN" if bool(torch.isnan(first.output).any()) else "inf"
            msg += f"; the first {kind} appears in {first.name}"
            if first.location:
                msg += f" at {first.location}"
        msg += ", where the reference stays finite"
        if code == "unstable_softmax":
            msg += ": exp() overflows; subtract each row's maximum first, or use torch.softmax"
        return Failure(stage, code, msg, first.location if first is not None else None)

    def _explain_quickly(self) -> tuple[Mutation, dict] | None:
        """Search the catalogue on a short probe, then confirm on the full one.

        The mistakes do not depend on the length; a long probe (a GPT-2 layer at 128
        tokens) would make every one of ~100 mutations cost as much as the layer itself.
        """
        full = self.calls
        short = None
        if full[0].x.shape[1] > SHORT and self.reprobe is not None:
            short = self.reprobe()
        if not short:
            return self._explain(full)
        hit = self._explain(short)
        if hit is None:
            return None  # the catalogue does not depend on the length: no need to rerun
        mut = hit[0]
        projs = [project(c.x, self.spec, self.w, c.context) for c in full]
        confirmed = [self._mutant(c, p, mut) for c, p in zip(full, projs, strict=True)]
        if all(o is not None for o in confirmed):
            return mut, confirmed[0]
        return self._explain(full)

    def _explain(self, calls: list[Call]) -> tuple[Mutation, dict] | None:
        ref_outs = [pipeline(c.x, self.spec, self.w, context=c.context)["output"] for c in calls]
        tokens = calls[0].x.shape[1]
        batch = max(c.x.shape[0] for c in calls)
        # one combined weight: queries and keys exchanged reads as chunks taken in the wrong
        # order, unless the line that makes the scores names the keys first (k @ q^T)
        combined = self.w is not None and "[q|k|v]" in self.w.source and not self.keys_named_first
        biases = (None, None, None) if self.w is None else (self.w.bq, self.w.bk, self.w.bv)
        combined_kv = self.w is not None and "[k|v]" in self.w.source
        candidates = catalogue(Context(self.spec, tokens, batch, combined, biases, combined_kv))
        projs = [project(c.x, self.spec, self.w, c.context) for c in calls]
        first = None
        for mut in candidates:
            outs = []
            for c, p in zip(calls, projs, strict=True):
                out = self._mutant(c, p, mut)
                if out is None:
                    break
                outs.append(out)
            else:
                if not all(close(o["output"], r) for o, r in zip(outs, ref_outs, strict=True)):
                    if first is None and self._masked_seen_right(mut, calls[0]):
                        # the masked scores the layer made are the reference's: a later
                        # mistake that gives the same output is the one (a softmin reads as
                        # a fill of +inf wherever every row hides some key)
                        first = (mut, outs[0])
                        continue
                    return mut, outs[0]
        if first is not None:
            return first
        template = next((m for m in candidates if m.code == "missing_scale"), None)
        if template is not None:
            return self._fit_scale(template, calls)
        return None

    def _masked_seen_right(self, mut: Mutation, call: Call) -> bool:
        """Whether ``mut`` blames the masked scores while the layer's own masked scores,
        recorded, are the reference's."""
        if mut.stage is not Stage.MASKED_SCORES:
            return False
        ref = pipeline(call.x, self.spec, self.w, context=call.context).get("masked_scores")
        if ref is None:
            return False
        found = find_stage(
            call.ops + call.sdpa_ops,
            Stage.MASKED_SCORES,
            ref,
            batched=call.batched,
            spec_scale=self.spec.scale,
            causal=self.spec.causal,
        )
        return found is not None

    def _mutant(self, call: Call, proj, mut: Mutation) -> dict | None:
        """The mutation's stages for this call if its output is the user's, else None.

        An unbatched call may have been batched inside the user's code, so axis numbers
        are tried in both layouts.
        """
        layouts = [call.batched] + ([True] if not call.batched and mut.user_dim is not None else [])
        if mut.reweigh and self.w is not None:
            # keys or values projected from their sequence with another role's weights
            source = call.x if call.context is None else call.context
            made = list(proj)
            for role, frm in mut.reweigh:
                w, b = getattr(self.w, frm), getattr(self.w, f"b{frm}")
                if w.shape[0] != source.shape[-1] or w.shape != getattr(self.w, role).shape:
                    return None  # that role's weights do not take this sequence
                made["qkv".index(role)] = source @ w if b is None else source @ w + b
            proj, mut = tuple(made), replace(mut, reweigh=())
        if mut.kv_from_queries and call.kv_own is not None:
            # the queries' own input as the key/value projections read it
            _, k, v = project(call.kv_own, self.spec, self.w)
            proj, mut = (proj[0], k, v), replace(mut, kv_from_queries=False)
        for batched in layouts:
            try:
                stages = pipeline(call.x, self.spec, self.w, mut, proj, batched=batched)
                if close(call.out, stages["output"]):
                    return stages
                if torch.isnan(stages["weights"]).any():
                    # a row with every key masked: NaN in the math, 0 in fused kernels,
                    # every key alike where the mask is filled with a finite minimum
                    for rows in (0.0, "uniform"):
                        stages = pipeline(
                            call.x, self.spec, self.w, mut, proj, batched=batched, nan_rows=rows
                        )
                        if close(call.out, stages["output"]):
                            return stages
            except (RuntimeError, ValueError, IndexError):
                continue
        return None

    def _fit_scale(self, template: Mutation, calls: list[Call]) -> tuple[Mutation, dict] | None:
        """A scale factor nobody named: search it on a log grid, then refine."""

        projs = [project(call.x, self.spec, self.w, call.context) for call in calls]

        def err(c: float) -> float:
            total = 0.0
            for call, p in zip(calls, projs, strict=True):
                o = pipeline(call.x, self.spec, self.w, with_scale(template, c, ""), p)["output"]
                if o.shape != call.out.shape:
                    return math.inf
                d = (o - call.out).abs()
                if not torch.isfinite(d).all():
                    return math.inf
                total += (d.max() / max(call.out.abs().max().item(), 1e-12)).item()
            return total

        grid = [10 ** (e / 10) for e in range(-40, 31)]  # up to 1000: a lost parenthesis
        errs = [err(c) for c in grid]
        i = min(range(len(grid)), key=errs.__getitem__)
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        for _ in range(30):  # golden-section refinement in log space
            a, b = math.log(lo), math.log(hi)
            m1, m2 = math.exp(a + (b - a) * 0.382), math.exp(a + (b - a) * 0.618)
            if err(m1) < err(m2):
                hi = m2
            else:
                lo = m1
        c = math.sqrt(lo * hi)
        if math.isclose(c, self.spec.scale, rel_tol=1e-3):
            return None
        tokens = calls[0].x.shape[1]
        mut = with_scale(template, c, describe_scale(c, self.spec, tokens))
        outs = [pipeline(call.x, self.spec, self.w, mut, context=call.context) for call in calls]
        if not all(
            close(call.out, o["output"], rtol=1e-3) for call, o in zip(calls, outs, strict=True)
        ):
            return None
        if self._at_longer(mut) is False:
            # another factor at another length: a scale made from the token count
            raise Unsupported(
                f"not supported yet: a softmax scale that changes with the sequence's length "
                f"({c:.4g} at {tokens} tokens, another at {self.longer}: a scale growing with "
                "log(tokens), proportional attention?)"
            )
        return mut, outs[0]

    def _where(self, mut: Mutation, stages: dict, call: Call) -> str | None:
        """The line of the user's code that made the wrong stage's tensor."""
        t = stages.get(mut.stage.value)
        ops = call.ops + call.sdpa_ops
        if t is not None and mut.stage is not Stage.OUTPUT:
            # the same numbers may be made twice (keys made with W_query equal the queries):
            # the line is the one whose tensor plays this stage's part in the computation
            first = None
            for _ in range(8):
                f = find_stage(
                    ops,
                    mut.stage,
                    t,
                    batched=call.batched,
                    spec_scale=self.spec.scale,
                    causal=self.spec.causal,
                )
                if f is None:
                    break
                first = first or f
                role = self.stage_of(call, f.op) if self.stage_of is not None else None
                if role is None or role is mut.stage:
                    return f.location or (first.location if first else None)
                ops = [op for op in ops if op is not f.op]
            if first is not None and first.location:
                return first.location
        located = [op for op in call.ops if op.location]
        if mut.stage is Stage.OUTPUT and located:
            return located[-1].location
        return None

    def _message(self, mut: Mutation, where: str | None) -> str:
        msg = MISTAKES[mut.code].message(mut, self.spec)
        return msg + (f". Look at {where}" if where else "")

    def _fallback(self, found, refs, call) -> tuple[Failure, torch.Tensor | None]:
        """No known mistake reproduces the output: blame the first stage not found.

        A stage that was not seen is excused when a later stage that depends on it was
        seen (it was computed inline); values feed only the context and the output.
        """
        order = self._stage_list()
        swapped = self._substitute(call, refs)
        if swapped is not None:
            stage, op, factor = swapped
            user = op.output.double() if call.batched else op.output.double().unsqueeze(0)
            user = user / factor
            ref = refs[stage]
            gap = (user - ref).abs().nan_to_num(0).max().item()
            near = close(user, ref, rtol=1e-2)  # right to 1%: a loss of precision, not logic
            code = "other" if near else self._guess_code(stage, found, op.output / factor)
            what = MISTAKES[code].meaning if code != "other" else "it differs from the reference"
            if near:
                what = (
                    f"it differs from the reference only by rounding (up to {gap:.2g}), which "
                    "is enough to change the output: computed in lower precision?"
                )
            msg = (
                f"{stage.value}: {what}: the tensor made here (differing by up to {gap:.3g}), "
                f"used in place of the reference {stage.value}, reproduces the output"
            )
            if op.location:
                msg += f". Look at {op.location}"
            return Failure(stage, code, msg, op.location), op.output
        last_found = None
        for i, stage in enumerate(order):
            if found.get(stage) is not None:
                last_found = found[stage]
                continue
            later = order[i + 1 :]
            if stage in (Stage.QUERIES, Stage.KEYS):
                later = [s for s in later if s is not Stage.VALUES]
            elif stage is Stage.VALUES:
                later = [s for s in later if s in (Stage.CONTEXT, Stage.OUTPUT)]
            if any(found.get(s) is not None for s in later):
                continue  # unseen, but a stage computed from it matches: it was inline
            code = self._guess_code(stage, found, None)
            msg = (
                f"{stage.value}: no tensor in the implementation equals the reference "
                f"{stage.value} ({stage.rule}), and no known mistake explains the output"
            )
            if code != "other":
                msg = f"{stage.value}: {MISTAKES[code].meaning} (no known variant matches exactly)"
            where = last_found.location if last_found else None
            if where:
                msg += f". The last stage that matched was computed at {where}; look just after it"
            return Failure(stage, code, msg, where), None
        final = order[-1]
        where = found[final].location if found.get(final) else None
        if final is Stage.OUTPUT and self._dropped(found[final].op, call):
            # made, and then nothing reads it: what is returned never went through it
            msg = (
                f"output: {MISTAKES['missing_out_proj'].meaning}: it is computed at {where} "
                "and then dropped; what is returned is made without it"
            )
            return Failure(final, "missing_out_proj", msg, where), None
        msg = (
            f"{final.value}: every stage matches the reference, but the tensor returned is not "
            f"the {final.value} computed"
            + (f" at {where}" if where else "")
            + ": something is done to it before it is returned"
        )
        return Failure(final, "other", msg, where), None

    @staticmethod
    def _dropped(op: Op, call: Call) -> bool:
        """Whether no op of the call's record read ``op``'s output after it was made."""
        rec = call.record
        if rec is None or op.index < 0 or op.index >= len(rec.ops) or rec.ops[op.index] is not op:
            return False
        return not any(op.index in later.args for later in rec.ops[op.index + 1 :])

    def _substitute_fused_inputs(self, call: Call, refs) -> tuple[Stage, Op] | None:
        """Queries, keys and values as a fused attention call received them, swapped in
        together: two of them wrong at once (keys and values cut from one head) show here."""
        qkv = (Stage.QUERIES, Stage.KEYS, Stage.VALUES)
        for fused in call.fused:
            name = "argument of scaled_dot_product_attention"
            trio = [Op(name, t, fused.location, -1) for t in (fused.query, fused.key, fused.value)]
            users = [
                op.output.double() if call.batched else op.output.double().unsqueeze(0)
                for op in trio
            ]
            if any(
                st not in refs or u.shape != refs[st].shape
                for u, st in zip(users, qkv, strict=True)
            ):
                continue
            mut = Mutation(
                "other",
                Stage.QUERIES,
                "",
                replace={st.value: u for st, u in zip(qkv, users, strict=True)},
            )
            try:
                out = pipeline(call.x, self.spec, self.w, mut, context=call.context)["output"]
            except (RuntimeError, ValueError):
                continue
            wrong = [
                (st, op)
                for st, u, op in zip(qkv, users, trio, strict=True)
                if not close(u, refs[st])
            ]
            if wrong and close(call.out, out):
                return wrong[0]
        return None

    def _substitute(self, call: Call, refs) -> tuple[Stage, Op, float] | None:
        """The first stage whose reference, swapped for a tensor the user made, gives the output
        (with the factor the user's tensor carries: a scale folded into the queries).

        Catches changes nobody catalogued: values normalised, weights renormalised oddly.
        """
        joint = self._substitute_fused_inputs(call, refs)
        if joint is not None:
            return (*joint, 1.0)
        # a score tensor may carry the scale already (folded into the queries or keys)
        folded = self.spec.scale if self.spec is not None else 1.0
        stages = [s for s in self._stage_list() if s not in (Stage.OUTPUT, Stage.QUERY)]
        for stage in stages:
            ref = refs.get(stage)
            if ref is None:
                continue
            shape = ref.shape if call.batched else ref.shape[1:]
            for op in [*call.ops, *call.sdpa_ops]:  # a fused call's stages, rebuilt
                if op.output.shape != shape or op.stale or not op.comparable:
                    continue
                user = op.output.double() if call.batched else op.output.double().unsqueeze(0)
                if torch.equal(user, ref):
                    continue
                factors = [1.0] if stage is not Stage.SCORES or folded == 1.0 else [1.0, folded]
                for factor in factors:
                    mut = Mutation("other", stage, "", replace={stage.value: user / factor})
                    try:
                        out = pipeline(call.x, self.spec, self.w, mut, context=call.context)[
                            "output"
                        ]
                    except (RuntimeError, ValueError):
                        continue
                    if close(call.out, out):
                        return stage, op, factor
        return None

    def _guess_code(self, stage: Stage, found, user: torch.Tensor | None) -> str:
        """The code whose recogniser knows the user's tensor at ``stage`` (see
        :func:`.mistakes.recognise`)."""
        call = self.calls[0]
        u = None
        if user is not None:
            u = user.double() if call.batched else user.double().unsqueeze(0)
        ref = pipeline(call.x, self.spec, self.w, context=call.context)
        return recognise(stage, Evidence(u, ref, found))
