"""The checker: run the target, rebuild the reference, walk the stages, name the mistake.

1. Load and build the target; put modules in eval mode; find their weights.
2. Probe it: a batch of two different sequences (and each sequence alone where the target
   takes unbatched input), and the same batch at large magnitude, recording every op.
3. Rebuild the reference pipeline in float64 from the target's own weights. If the
   outputs agree (and stay finite at large magnitude) the implementation is correct,
   whatever its style; each stage is reported where it was seen.
4. Otherwise run the reference with each known mistake in turn: the earliest-stage mistake
   that reproduces the target's output is the diagnosis. Where none does, the first stage
   whose reference tensor is nowhere among the recorded tensors fails with ``other``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import AttnScopeError, describe
from ..stages import KINDS, Dims, Stage, stages_for_kind
from .binding import WEIGHT_HELP, Binding, bind
from .compare import Found, close, find_stage
from .mistakes import MISTAKES
from .record import Op, Recorder
from .reference import (
    Mutation,
    Spec,
    Weights,
    describe_scale,
    mutations,
    pipeline,
    project,
    scores_kind_mutations,
    with_scale,
)
from .report import CheckReport, Failure, StageCheck
from .target import SIZES, Target, call_safely, load

__all__ = ["check"]

_BATCH = 2
_LARGE = 60.0  # large-magnitude probe: float32 exp overflows past scores of ~88


def check(
    target: str | object,
    *,
    kind: str | None = None,
    init: dict | None = None,
    seed: int = 0,
    timeout: float | None = None,
    weights: dict[str, str] | None = None,
    tokens: int | None = None,
) -> CheckReport:
    """Check an attention implementation against the reference, stage by stage.

    Args:
        target: ``"path/to/file.py:NAME"``, ``"package.module:NAME"``, or the object itself:
            an ``nn.Module`` instance, a zero-argument factory returning one, an ``nn.Module``
            class, or a function (``f(inputs) -> context`` for kind ``simplified``,
            ``f(inputs, query_index) -> scores`` for kind ``scores``).
        kind: one of :data:`~attnscope.stages.KINDS`; inferred (and the reason given) if omitted.
        init: constructor keyword arguments for a class; inferred from their names if omitted.
        seed: seeds construction and the probe inputs.
        timeout: seconds each call of the target may take.
        weights: roles to parameter/submodule paths (``{"query": "W_q", ...}``) where the
            weights cannot be found by their names.
        tokens: probe length; by default a small number that differs from every size.

    Returns:
        A :class:`CheckReport`; ``report.ok`` is True when every stage matches.

    Raises:
        AttnScopeError: the check could not be done (the target cannot be loaded, raises,
            returns the wrong shape or type, or runs past ``timeout``).
    """
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2
    ):
        raise AttnScopeError(f"--tokens: expected an integer of at least 2, got {tokens!r}")
    tgt = load(target, kind=kind, init=init, seed=seed)
    if tgt.is_module:
        chk = _ModuleCheck(tgt, kind, seed, timeout, weights)
        chk.fixed_tokens = tokens
        return chk.run()
    return _FunctionCheck(tgt, kind, seed, timeout).run()


# ------------------------------------------------------------------------------- shared


@dataclass
class _Call:
    """One call of the target: the float64 input in reference layout and what came back."""

    x: torch.Tensor  # (B, T, d) float64; B = 1 for an unbatched call
    out: torch.Tensor  # (B, T, d_out) float64
    batched: bool
    ops: list[Op] = field(default_factory=list)
    sdpa_ops: list[Op] = field(default_factory=list)


def _first_tensor(result: object) -> object:
    if isinstance(result, (tuple, list)) and result:
        return result[0]
    if hasattr(result, "to_tuple"):  # Hugging Face ModelOutput
        return result.to_tuple()[0]
    return result


def _rebuild_sdpa(rec: Recorder) -> list[Op]:
    """Stages hidden inside fused scaled_dot_product_attention calls, rebuilt from its args."""
    ops: list[Op] = []
    for call in rec.sdpa:
        q, k = call.query.double(), call.key.double()
        scores = q @ k.transpose(-2, -1)
        scale = call.scale if call.scale is not None else 1 / math.sqrt(q.shape[-1])
        scaled = scores * scale
        logits = scaled
        if call.is_causal:
            n, m = scaled.shape[-2:]
            hide = torch.ones(n, m, dtype=torch.bool).triu(1)
            logits = scaled.masked_fill(hide, -torch.inf)
        if call.attn_mask is not None:
            mask = call.attn_mask
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask, -torch.inf)
            else:
                logits = logits + mask.double()
        weights = torch.softmax(logits, dim=-1)
        where = call.location
        name = "scaled_dot_product_attention (rebuilt from its arguments)"
        for t in (scores, scaled, logits, weights, call.output):
            ops.append(Op(name, t, where, -1))
    return ops


def _fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _seen(found: Found | None, stage: Stage, per_head: bool) -> str:
    if found is None:
        return "not seen as a tensor (fused or computed inline); consistent with the output"
    bits = [f"matches the reference: {found.op.name}"]
    if found.location:
        bits.append(f"at {found.location}")
    if found.layout:
        bits.append(f"(layout: {found.layout})")
    if abs(found.factor - 1) > 1e-3:
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


class _Base:
    kind: str
    tgt: Target
    calls: list[_Call]
    spec: Spec | None = None
    kind_reason: str = ""
    notes: list[str]

    def _stage_list(self) -> list[Stage]:
        stages = list(stages_for_kind(self.kind))
        if self.spec is not None and self.spec.has_out and Stage.OUTPUT not in stages:
            stages.append(Stage.OUTPUT)
        return stages

    def _report(
        self,
        failure: Failure | None,
        found: dict[Stage, Found | None],
        refs: dict[Stage, torch.Tensor],
        dims: Dims,
        user_tensor: torch.Tensor | None = None,
        user_full: torch.Tensor | None = None,
    ) -> CheckReport:
        checks: list[StageCheck] = []
        per_head = self.spec is not None and self.spec.num_heads > 1
        order = self._stage_list()
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
                        failure.message.split(". ")[0],
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
                    _seen(f, stage, per_head),
                    predicted,
                    actual,
                    f.location if f else None,
                    ref0,
                    None,
                )
            )
        return CheckReport(
            ok=failure is None,
            kind=self.kind,
            target=self.tgt.text,
            first_failure=failure,
            checks=checks,
            kind_reason=self.kind_reason,
            notes=self.notes,
        )


# ------------------------------------------------------------------------------ modules


class _ModuleCheck(_Base):
    def __init__(self, tgt: Target, kind, seed, timeout, weights):
        self.tgt, self.kind, self.seed, self.timeout, self.weights = (
            tgt,
            kind,
            seed,
            timeout,
            weights,
        )
        self.module: nn.Module = tgt.obj
        self.notes = []
        self.gen = torch.Generator().manual_seed(seed)

    # -- setup ---------------------------------------------------------------------------
    def run(self) -> CheckReport:
        self.module.eval()
        binding = self._bind()
        self.binding = binding
        self.adapter = self._adapter()
        tokens = self._tokens(binding)
        widths = (
            [self._guess_width()]
            if binding is None
            else sorted({c.q.shape[0] for c in binding.candidates}, key=lambda d: d != binding.d_in)
        )
        for i, d_in in enumerate(widths):
            x = torch.randn(_BATCH, tokens, d_in, generator=self.gen)
            try:
                self.calls = self._probe(x)
                break
            except AttnScopeError:
                if i == len(widths) - 1:
                    raise
        if binding is not None:
            binding.candidates = [c for c in binding.candidates if c.q.shape[0] == d_in]
            binding.d_in, binding.d_out = d_in, binding.candidates[0].q.shape[1]
        if self.kind is None:
            self.kind, self.kind_reason = self._infer_kind(binding, tokens, d_in)
        else:
            self.kind_reason = "given with --kind"
        if self.kind in ("scores",):
            raise AttnScopeError(
                "--kind scores: expected a function f(inputs, query_index), got an nn.Module"
            )
        if self.kind == "simplified":
            return self._judge([(None, Spec("simplified", d_in, d_in))])
        if binding is None:
            raise AttnScopeError(
                f"{type(self.module).__name__}: expected query, key and value weights; "
                + WEIGHT_HELP
            )
        return self._judge(self._specs(binding))

    def _bind(self) -> Binding | None:
        if not any(True for _ in self.module.parameters()):
            return None  # weightless attention
        if self.kind == "simplified":
            return None
        return bind(self.module, self.weights)

    def _guess_width(self) -> int:
        return 5

    def _context_limit(self) -> int | None:
        m = self.module
        for attr in (
            "context_length",
            "block_size",
            "max_seq_len",
            "max_len",
            "n_positions",
            "max_position_embeddings",
            "n_ctx",
        ):
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        cfg = getattr(m, "config", None)
        for attr in ("n_positions", "max_position_embeddings"):
            v = getattr(cfg, attr, None)
            if isinstance(v, int):
                return v
        for _name, buf in m.named_buffers():
            if buf.dim() >= 2 and buf.shape[-1] == buf.shape[-2] and buf.shape[-1] > 1:
                return buf.shape[-1]
        return None

    fixed_tokens: int | None = None

    def _tokens(self, binding: Binding | None) -> int:
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        taken = {_BATCH}
        if binding is not None:
            taken |= {binding.d_in, binding.d_out}
            if binding.num_heads:
                taken |= {binding.num_heads, binding.d_out // binding.num_heads}
        limit = self._context_limit()
        for n in (SIZES["tokens"], 5, 6, 11, 13, 9, 3, 17, 19, 4, 8):
            if n not in taken and (limit is None or n <= limit):
                return n
        return max(2, min(limit or 7, 7))

    def _adapter(self):
        """How to call the module: f(x), f(x, x, x), tokens-first, or with an HF mask."""
        m = self.module
        try:
            params = [
                p
                for p in inspect.signature(m.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            params = []
        required = [p for p in params if p.default is inspect.Parameter.empty]
        qkv = len(required) >= 3
        seq_first = isinstance(m, nn.MultiheadAttention) and not m.batch_first
        hf = type(m).__module__.startswith("transformers") and any(
            p.name == "attention_mask" for p in params
        )
        return {"qkv": qkv, "seq_first": seq_first, "hf": hf}

    def _invoke(self, x32: torch.Tensor, causal_hint: bool = False):
        a = self.adapter
        inp = x32
        batched = x32.dim() == 3
        if a["seq_first"] and batched:
            inp = x32.transpose(0, 1)
        kwargs = {}
        if a["hf"] and causal_hint:
            n = x32.shape[-2]
            mask = torch.zeros(n, n).masked_fill(
                torch.ones(n, n, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min
            )
            kwargs["attention_mask"] = mask.expand(x32.shape[0] if batched else 1, 1, n, n)
        args = (inp, inp, inp) if a["qkv"] else (inp,)
        result, err = call_safely(self.module, *args, timeout=self.timeout, **kwargs)
        if err is not None:
            return None, err
        out = _first_tensor(result)
        if not isinstance(out, torch.Tensor):
            raise AttnScopeError(
                f"{self.tgt.text}: expected the module to return a tensor (or a tuple whose first "
                f"element is one), got {describe(out)}"
            )
        if a["seq_first"] and batched and out.dim() == 3:
            out = out.transpose(0, 1)
        return out, None

    def _probe(self, x: torch.Tensor, causal_hint: bool = False) -> list[_Call]:
        """Call batched, then each sequence alone; keep every call that works."""
        self.causal_hint = causal_hint
        calls: list[_Call] = []
        errors = []
        rec = Recorder()
        with rec:
            out, err = self._invoke(x, causal_hint)
        if err is None:
            self._expect_shape(out, x)
            calls.append(_Call(x.double(), out.double(), True, rec.ops, _rebuild_sdpa(rec)))
        else:
            errors.append(f"batched input {_fmt_shape(x.shape)}: {err}")
        rec1 = Recorder()
        with rec1:
            out1, err1 = self._invoke(x[0], causal_hint)
        if err1 is None:
            self._expect_shape(out1, x[0])
            calls.append(
                _Call(
                    x[:1].double(), out1.double().unsqueeze(0), False, rec1.ops, _rebuild_sdpa(rec1)
                )
            )
        else:
            errors.append(f"unbatched input {_fmt_shape(x[0].shape)}: {err1}")
        if not calls:
            raise AttnScopeError(f"{self.tgt.text} raised on every probe: " + "; ".join(errors))
        if len(calls) == 1:
            self.notes = [n for n in self.notes if "accepts only" not in n]
            which = "batched" if calls[0].batched else "unbatched"
            self.notes.append(f"accepts only {which} input ({errors[0]})")
        return calls

    def _expect_shape(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if out.dim() != x.dim() or out.shape[:-1] != x.shape[:-1] or not out.is_floating_point():
            raise AttnScopeError(
                f"{self.tgt.text}: expected an output with one row per token, shape "
                f"{_fmt_shape((*x.shape[:-1], 'd_out'))}, got {describe(out)}"
            )

    # -- kind ----------------------------------------------------------------------------
    def _infer_kind(self, binding: Binding | None, tokens: int, d_in: int) -> tuple[str, str]:
        m = self.module
        if binding is None:
            return "simplified", "it has no trainable weights"
        reasons = []
        if binding.num_heads is None:
            seen = self._heads_seen(tokens, binding.d_out)
            if seen is not None:
                binding.num_heads = seen
                binding.source += f"; {seen} heads seen in its computation"
        multi = (binding.num_heads or 1) > 1 or isinstance(m, nn.MultiheadAttention)
        if multi:
            reasons.append(f"{binding.num_heads} heads ({binding.source})")
        causal_why = self._static_causal()
        if causal_why is None and self._behaves_causal(tokens, d_in):
            causal_why = "its outputs do not change when later tokens change"
        if causal_why:
            reasons.append(f"causal: {causal_why}")
            if multi and self.adapter["hf"]:
                self.calls = self._probe(self.calls[0].x.float(), causal_hint=True)
        kind = ("causal-" if causal_why else "") + ("multihead" if multi else "self")
        if kind == "causal-self":
            kind = "causal"
        if not multi:
            reasons.append("one head")
        return kind, "; ".join(reasons)

    def _heads_seen(self, tokens: int, d_out: int) -> int | None:
        """Heads from the computation: a fused call's (B, H, T, hd) query, or a
        (B, T, H, hd) / (B, H, T, hd) view of the projections."""
        call = self.calls[0]
        for op in call.sdpa_ops:
            t = op.output
            if t.dim() == 4 and t.shape[-2] == tokens and t.shape[1] > 1:
                return t.shape[1]
        for op in call.ops:
            shape = tuple(op.output.shape)[-3:]
            if len(shape) < 3:
                continue
            for h, n, hd in ((shape[1], shape[0], shape[2]), (shape[0], shape[1], shape[2])):
                if n == tokens and h > 1 and h * hd == d_out and h != tokens:
                    return h
        return None

    def _static_causal(self) -> str | None:
        m = self.module
        for attr in ("is_causal", "causal"):
            v = getattr(m, attr, None)
            if isinstance(v, bool):
                return f"{attr}={v}" if v else None
        for name, buf in m.named_buffers(recurse=True):
            if buf.dim() >= 2 and buf.shape[-1] == buf.shape[-2] and buf.shape[-1] > 1:
                return f"a square buffer {name!r} {tuple(buf.shape)} (a causal mask)"
        if self.tgt.init:
            for key in self.tgt.init:
                if key.lower() in ("context_length", "block_size", "max_seq_len", "n_positions"):
                    return f"its constructor takes {key}"
        if "causal" in type(m).__name__.lower():
            return f"its name {type(m).__name__}"
        return None

    def _behaves_causal(self, tokens: int, d_in: int) -> bool:
        base = self.calls[0]
        x = base.x.float().clone()
        x[:, -2:] = torch.randn(x.shape[0], 2, d_in, generator=self.gen) * 3
        x_in = x if base.batched else x[0]
        out, err = self._invoke(x_in)
        if err is not None:
            return False
        out = out.double() if base.batched else out.double().unsqueeze(0)
        before, after = base.out[:, :-2], out[:, :-2]
        changed_late = not torch.allclose(base.out[:, -2:], out[:, -2:], atol=1e-5)
        return changed_late and torch.allclose(before, after, atol=1e-5, rtol=1e-4)

    def _specs(self, b: Binding) -> list[tuple[Weights, Spec]]:
        multi = self.kind in ("multihead", "causal-multihead")
        if multi:
            heads = (
                [b.num_heads]
                if b.num_heads
                else [h for h in range(1, b.d_out + 1) if b.d_out % h == 0]
            )
        else:
            heads = [1]
        return [
            (w, Spec(self.kind, b.d_in, b.d_out, h, b.has_out)) for h in heads for w in b.candidates
        ]

    # -- judging -------------------------------------------------------------------------
    def _judge(self, options: list[tuple[Weights | None, Spec]]) -> CheckReport:
        for w, spec in options:
            if all(close(c.out, pipeline(c.x, spec, w)["output"]) for c in self.calls):
                self.w, self.spec = w, spec
                return self._correct_or_unstable()
        # no reading reproduces the output: pick the one the recorded tensors confirm best
        self.w, self.spec = max(options, key=lambda o: self._confirmations(*o))
        return self._diagnose()

    def _confirmations(self, w, spec) -> int:
        call = self.calls[0]
        ref = pipeline(call.x, spec, w)
        ops = call.ops + call.sdpa_ops
        n = 0
        for stage in (Stage.QUERIES, Stage.KEYS, Stage.VALUES):
            if (
                stage.value in ref
                and find_stage(ops, stage, ref[stage.value][:, ...], batched=call.batched)
                is not None
            ):
                n += 1
        return n

    def _observe(self, call: _Call) -> tuple[dict[Stage, Found | None], dict[Stage, torch.Tensor]]:
        ref = pipeline(call.x, self.spec, self.w)
        ops = call.ops + call.sdpa_ops
        found: dict[Stage, Found | None] = {}
        refs: dict[Stage, torch.Tensor] = {}
        for stage in self._stage_list():
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

    def _dims(self, call: _Call) -> Dims:
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
        return self._report(failure, found, refs, self._dims(call))

    def _large_probe(self) -> Failure | None:
        """Correct on normal inputs: does it stay finite where torch.softmax does?"""
        call = self.calls[0]
        x = (call.x * _LARGE).float()
        rec = Recorder()
        with rec:
            out, err = self._invoke(x if call.batched else x[0], self.causal_hint)
        if err is not None:
            return None
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
            f"at {_LARGE:g}x the input magnitude {int(bad.sum())} output entries become inf or "
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
            user = stages.get(mut.stage.value)
            user0 = user[0] if user is not None and user.dim() >= 2 else user
            where = self._where(mut, stages, call)
            failure = Failure(mut.stage, mut.code, self._message(mut, where), where)
            return self._report(failure, found, refs, self._dims(call), user0, user)
        failure, user0 = self._fallback(found, refs, call)
        return self._report(failure, found, refs, self._dims(call), user0)

    def _explain_quickly(self) -> tuple[Mutation, dict] | None:
        """Search the catalogue on a short probe, then confirm on the full one.

        The mistakes do not depend on the length; a long probe (a GPT-2 layer at 128
        tokens) would make every one of ~100 mutations cost as much as the layer itself.
        """
        full = self.calls
        if full[0].x.shape[1] <= 16 or self.module is None:
            return self._explain(full)
        notes, fixed = list(self.notes), self.fixed_tokens
        self.fixed_tokens = None
        try:
            x = torch.randn(_BATCH, self._tokens(self.binding), self.spec.d_in, generator=self.gen)
            short = self._probe(x, self.causal_hint)
        except AttnScopeError:
            short = None
        finally:
            self.notes, self.fixed_tokens = notes, fixed
        if short:
            hit = self._explain(short)
            if hit is not None:
                mut = hit[0]
                projs = [project(c.x, self.spec, self.w) for c in full]
                confirmed = [self._mutant(c, p, mut) for c, p in zip(full, projs, strict=True)]
                if all(o is not None for o in confirmed):
                    return mut, confirmed[0]
            else:
                return None  # the catalogue does not depend on the length: no need to rerun
        return self._explain(full)

    def _explain(self, calls: list[_Call]) -> tuple[Mutation, dict] | None:
        ref_outs = [pipeline(c.x, self.spec, self.w)["output"] for c in calls]
        tokens = calls[0].x.shape[1]
        batch = max(c.x.shape[0] for c in calls)
        combined = self.w is not None and "[q|k|v]" in self.w.source
        candidates = mutations(self.spec, tokens, batch, combined_qkv=combined)
        projs = [project(c.x, self.spec, self.w) for c in calls]
        for mut in candidates:
            outs = []
            for c, p in zip(calls, projs, strict=True):
                out = self._mutant(c, p, mut)
                if out is None:
                    break
                outs.append(out)
            else:
                if not all(close(o["output"], r) for o, r in zip(outs, ref_outs, strict=True)):
                    return mut, outs[0]
        template = next((m for m in candidates if m.code == "missing_scale"), None)
        if template is not None:
            return self._fit_scale(template, calls)
        return None

    def _mutant(self, call: _Call, proj, mut: Mutation) -> dict | None:
        """The mutation's stages for this call if its output is the user's, else None.

        An unbatched call may have been batched inside the user's code, so axis numbers
        are tried in both layouts.
        """
        layouts = [call.batched] + ([True] if not call.batched and mut.user_dim is not None else [])
        for batched in layouts:
            try:
                stages = pipeline(call.x, self.spec, self.w, mut, proj, batched=batched)
            except (RuntimeError, ValueError, IndexError):
                continue
            if close(call.out, stages["output"]):
                return stages
        return None

    def _fit_scale(self, template: Mutation, calls: list[_Call]) -> tuple[Mutation, dict] | None:
        """A scale factor nobody named: search it on a log grid, then refine."""

        projs = [project(call.x, self.spec, self.w) for call in calls]

        def err(c: float) -> float:
            total = 0.0
            for call, p in zip(calls, projs, strict=True):
                o = pipeline(call.x, self.spec, self.w, with_scale(template, c, ""), p)["output"]
                d = (o - call.out).abs()
                if not torch.isfinite(d).all():
                    return math.inf
                total += (d.max() / max(call.out.abs().max().item(), 1e-12)).item()
            return total

        grid = [10 ** (e / 10) for e in range(-40, 21)]
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
        mut.code = "missing_scale" if math.isclose(c, 1.0, rel_tol=1e-3) else "wrong_scale"
        outs = [pipeline(call.x, self.spec, self.w, mut) for call in calls]
        if all(
            close(call.out, o["output"], rtol=1e-3) for call, o in zip(calls, outs, strict=True)
        ):
            return mut, outs[0]
        return None

    def _where(self, mut: Mutation, stages: dict, call: _Call) -> str | None:
        """The line of the user's code that made the wrong stage's tensor."""
        t = stages.get(mut.stage.value)
        ops = call.ops + call.sdpa_ops
        if t is not None and mut.stage is not Stage.OUTPUT:
            f = find_stage(
                ops,
                mut.stage,
                t,
                batched=call.batched,
                spec_scale=self.spec.scale,
                causal=self.spec.causal,
            )
            if f is not None and f.location:
                return f.location
        located = [op for op in call.ops if op.location]
        if mut.stage is Stage.OUTPUT and located:
            return located[-1].location
        return None

    def _message(self, mut: Mutation, where: str | None) -> str:
        s = self.spec
        stage = mut.stage.value
        meaning = MISTAKES[mut.code].meaning
        expected = {
            "wrong_projection": "expected queries = x @ W_query, keys = x @ W_key, "
            "values = x @ W_value",
            "heads_split": "expected (b, tokens, d_out) -> view(b, tokens, num_heads, head_dim)"
            " -> transpose(1, 2)",
            "scores_transposed": "expected queries @ keys.transpose(-2, -1): row i is query i",
            "wrong_key_index": "expected scores[i, j] = query_i . key_j, key j at column j",
            "not_dot_product": "expected the dot product query_i . key_j",
            "batch_mixing": "expected each sequence to attend only to its own tokens "
            "(matmul over the last two dims, batch kept apart)",
            "missing_scale": f"expected scores / sqrt(d_k) with d_k = keys.shape[-1] = "
            f"{s.head_dim} (factor {s.scale:.4g})",
            "wrong_scale": f"expected 1/sqrt(d_k) = 1/sqrt({s.head_dim}) = {s.scale:.4g}, "
            f"d_k being the keys' last dimension{' per head' if s.num_heads > 1 else ''}",
            "missing_mask": "expected scores of keys after the query (j > i) set to -inf",
            "mask_diagonal": "expected torch.triu(ones, diagonal=1): each token sees itself "
            "and the tokens before it, none after",
            "mask_fill_value": "expected -inf (or a very negative number) so masked keys get "
            "weight 0",
            "softmax_wrong_dim": "expected softmax over the keys, dim=-1, so each query's "
            "weights sum to 1",
            "not_softmax": "expected torch.softmax(scaled_scores, dim=-1)",
            "mask_after_softmax": "expected the mask on the scores before the softmax, so each "
            "row of weights still sums to 1",
            "context_wrong_product": "expected weights @ values: context_i = sum_j w_ij value_j",
            "heads_merge": "expected context.transpose(1, 2).reshape(b, tokens, d_out)",
            "missing_out_proj": "expected the output projection applied to the merged heads",
        }.get(mut.code, "")
        msg = f"{stage}: {meaning}: found {mut.label}"
        if mut.code == "wrong_scale" and s.simplified:
            msg = f"{stage}: scores scaled by {mut.facts.get('name')}"
            expected = "expected the raw scores: simplified attention (no trainable weights) is "
            expected += "not scaled"
        elif mut.code == "wrong_scale":
            msg = f"{stage}: scores scaled by {mut.facts.get('name')} instead of 1/sqrt(d_k)"
        msg += f". {expected[:1].upper()}{expected[1:]}" if expected else ""
        if where:
            msg += f". Look at {where}"
        return msg

    def _fallback(self, found, refs, call) -> tuple[Failure, torch.Tensor | None]:
        """No known mistake reproduces the output: blame the first stage not found.

        A stage that was not seen is excused when a later stage that depends on it was
        seen (it was computed inline); values feed only the context and the output.
        """
        order = self._stage_list()
        swapped = self._substitute(call, refs)
        if swapped is not None:
            stage, op = swapped
            code = self._guess_code(stage, found, op.output)
            what = MISTAKES[code].meaning if code != "other" else "it differs from the reference"
            msg = (
                f"{stage.value}: {what}: the tensor made here, used in place of the reference "
                f"{stage.value}, reproduces the output"
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
        msg = (
            f"{final.value}: every stage matches the reference, but the tensor returned is not "
            f"the {final.value} computed"
            + (f" at {where}" if where else "")
            + ": something is done to it before it is returned"
        )
        return Failure(final, "other", msg, where), None

    def _classify_scores(self, user: torch.Tensor) -> str:
        """Name what a user's score matrix is: transposed, shifted along keys, or not q . k."""
        call = self.calls[0]
        ref = pipeline(call.x, self.spec, self.w)["scores"]
        u = user.double() if call.batched else user.double().unsqueeze(0)
        if u.shape != ref.shape:
            return "not_dot_product"
        if close(u, ref.mT):
            return "scores_transposed"
        n = ref.shape[-1]
        for s in range(1, n):
            if close(u, ref.roll(s, dims=-1)):
                return "wrong_key_index"
            # shifted without wrapping: every column but the leftover one matches
            if close(u[..., : n - s], ref[..., s:]) or close(u[..., s:], ref[..., : n - s]):
                return "wrong_key_index"
        if close(u, ref.flip(-1)):
            return "wrong_key_index"
        return "not_dot_product"

    def _substitute(self, call: _Call, refs) -> tuple[Stage, Op] | None:
        """The first stage whose reference, swapped for a tensor the user made, gives the output.

        Catches changes nobody catalogued: values normalised, weights renormalised oddly.
        """
        stages = [s for s in self._stage_list() if s not in (Stage.OUTPUT, Stage.QUERY)]
        for stage in stages:
            ref = refs.get(stage)
            if ref is None:
                continue
            shape = ref.shape if call.batched else ref.shape[1:]
            for op in call.ops:
                if op.output.shape != shape or op.stale:
                    continue
                user = op.output.double() if call.batched else op.output.double().unsqueeze(0)
                if close(user, ref):
                    continue
                mut = Mutation("other", stage, "", replace={stage.value: user})
                try:
                    out = pipeline(call.x, self.spec, self.w, mut)["output"]
                except (RuntimeError, ValueError):
                    continue
                if close(call.out, out):
                    return stage, op
        return None

    def _classify_masked(self, user: torch.Tensor) -> str:
        """Name what a user's masked scores are: unmasked, a finite fill, the wrong cells."""
        call = self.calls[0]
        ref = pipeline(call.x, self.spec, self.w)
        u = user.double() if call.batched else user.double().unsqueeze(0)
        masked, scaled = ref["masked_scores"], ref["scaled_scores"]
        if u.shape != masked.shape:
            return "other"
        hidden = ~torch.isfinite(masked)
        if close(u, scaled):
            return "missing_mask"
        very_negative = ~torch.isfinite(u) | (u < -1e4)
        if not torch.equal(very_negative, hidden) and very_negative.any():
            return "mask_diagonal"
        fills = u[hidden]
        if fills.numel() and torch.isfinite(fills).all() and close(u[~hidden], scaled[~hidden]):
            return "mask_fill_value"
        return "other"

    def _guess_code(self, stage: Stage, found, user: torch.Tensor | None) -> str:
        if stage is Stage.SCORES and user is not None:
            return self._classify_scores(user)
        if stage is Stage.MASKED_SCORES and user is not None:
            return self._classify_masked(user)
        if stage is Stage.SCORES and found.get(Stage.QUERIES) and found.get(Stage.KEYS):
            return "not_dot_product"
        if stage is Stage.WEIGHTS:
            if user is not None:
                rows = user.double().nan_to_num(0).sum(-1)
                cols = user.double().nan_to_num(0).sum(-2)
                if torch.allclose(cols, torch.ones_like(cols), atol=1e-4) and not torch.allclose(
                    rows, torch.ones_like(rows), atol=1e-4
                ):
                    return "softmax_wrong_dim"
            return "not_softmax"
        if (
            stage is Stage.CONTEXT
            and user is None
            and found.get(Stage.WEIGHTS)
            and found.get(Stage.VALUES)
        ):
            return "context_wrong_product"
        return "other"


# ---------------------------------------------------------------------------- functions


class _FunctionCheck(_Base):
    def __init__(self, tgt: Target, kind, seed, timeout):
        self.tgt, self.kind, self.seed, self.timeout = tgt, kind, seed, timeout
        self.notes = []
        self.gen = torch.Generator().manual_seed(seed)
        self.spec = None

    def run(self) -> CheckReport:
        fn = self.tgt.obj
        try:
            n_params = len(
                [
                    p
                    for p in inspect.signature(fn).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                ]
            )
        except (TypeError, ValueError):
            n_params = 1
        if self.kind is None:
            if n_params >= 2:
                self.kind, self.kind_reason = (
                    "scores",
                    "a function of two arguments f(inputs, query_index)",
                )
            else:
                self.kind, self.kind_reason = "simplified", "a function of one argument f(inputs)"
        else:
            self.kind_reason = "given with --kind"
        if self.kind not in ("scores", "simplified"):
            raise AttnScopeError(
                f"--kind {self.kind}: expected a module (class, instance or factory) for this "
                f"kind; a plain function can be checked as 'scores' or 'simplified'"
            )
        tokens, d = SIZES["tokens"], 5
        x = torch.randn(tokens, d, generator=self.gen)
        if self.kind == "scores":
            return self._scores(x)
        return self._simplified(x)

    def _call(self, *args):
        result, err = call_safely(self.tgt.obj, *args, timeout=self.timeout)
        if err is not None:
            raise AttnScopeError(f"{self.tgt.text} raised {err}")
        out = _first_tensor(result)
        if not isinstance(out, torch.Tensor):
            raise AttnScopeError(f"{self.tgt.text}: expected a tensor, got {describe(out)}")
        return out

    def _scores(self, x: torch.Tensor) -> CheckReport:
        n = x.shape[0]
        queries = [1, 0, n - 1, 4]
        outs, recs = [], []
        for i in queries:
            rec = Recorder()
            with rec:
                out = self._call(x, i)
            if out.shape != (n,):
                out = out.reshape(-1) if out.numel() == n else out
            if out.shape != (n,) or not out.is_floating_point():
                raise AttnScopeError(
                    f"{self.tgt.text}: expected one score per token, shape ({n},), got "
                    f"{describe(out)}"
                )
            outs.append(out.double())
            recs.append(rec)
        x64 = x.double()
        dims = Dims(tokens=n, d_in=x.shape[1], d_out=x.shape[1])
        refs = {Stage.QUERY: x64[queries[0]], Stage.SCORES: x64 @ x64[queries[0]]}
        ops = recs[0].ops
        found = {
            Stage.QUERY: find_stage(ops, Stage.QUERY, refs[Stage.QUERY], batched=False),
            Stage.SCORES: find_stage(ops, Stage.SCORES, refs[Stage.SCORES], batched=False),
        }
        if all(close(o, x64 @ x64[i]) for o, i in zip(outs, queries, strict=True)):
            return self._report(None, found, refs, dims)
        for code, stage, label, fn in scores_kind_mutations(n):
            try:
                predicted = [fn(x64, i) for i in queries]
            except (RuntimeError, IndexError):
                continue
            if all(close(o, p) for o, p in zip(outs, predicted, strict=True)):
                user = x64 @ x64[0] if stage is Stage.QUERY else predicted[0]
                if code == "wrong_query_token":
                    user = self._query_used(x64, outs[0])
                where = self._scores_where(ops, stage, user)
                msg = f"{stage.value}: {MISTAKES[code].meaning}: found {label}"
                msg += {
                    "wrong_query_token": f". Expected query = inputs[{queries[0]}] for "
                    f"query_index={queries[0]}",
                    "wrong_key_index": ". Expected scores[j] = inputs[j] . query at index j",
                    "not_dot_product": ". Expected torch.dot(inputs[j], query)",
                }.get(code, "")
                if where:
                    msg += f". Look at {where}"
                return self._report(Failure(stage, code, msg, where), found, refs, dims, user)
        stage = Stage.QUERY if found[Stage.QUERY] is None else Stage.SCORES
        msg = (
            f"{stage.value}: the scores differ from inputs @ inputs[query_index], and no "
            "known mistake explains them"
        )
        return self._report(Failure(stage, "other", msg, None), found, refs, dims, outs[0])

    def _query_used(self, x64, out):
        for j in range(x64.shape[0]):
            if close(out, x64 @ x64[j]):
                return x64[j]
        return None

    def _scores_where(self, ops, stage, user) -> str | None:
        if user is not None:
            f = find_stage(ops, stage, user, batched=False)
            if f is not None:
                return f.location
        located = [op for op in ops if op.location]
        return located[-1].location if located else None

    def _simplified(self, x: torch.Tensor) -> CheckReport:
        calls = []
        errors = []
        xb = torch.stack([x, torch.randn(x.shape, generator=self.gen)])
        for inp, batched in ((x, False), (xb, True)):
            rec = Recorder()
            with rec:
                result, err = call_safely(self.tgt.obj, inp, timeout=self.timeout)
            if err is not None:
                errors.append(f"{'batched' if batched else 'unbatched'}: {err}")
                continue
            out = _first_tensor(result)
            if not isinstance(out, torch.Tensor) or out.shape != inp.shape:
                raise AttnScopeError(
                    f"{self.tgt.text}: expected context vectors of the input's shape "
                    f"{_fmt_shape(inp.shape)}, got {describe(out)}"
                )
            x3 = inp.double() if batched else inp.double().unsqueeze(0)
            o3 = out.double() if batched else out.double().unsqueeze(0)
            calls.append(_Call(x3, o3, batched, rec.ops, _rebuild_sdpa(rec)))
        if not calls:
            raise AttnScopeError(f"{self.tgt.text} raised on every probe: " + "; ".join(errors))
        if len(calls) == 1:
            self.notes.append(
                f"accepts only {'batched' if calls[0].batched else 'unbatched'} input"
            )
        self.calls = calls
        check = _ModuleCheck.__new__(_ModuleCheck)
        check.tgt, check.kind, check.notes, check.calls = self.tgt, "simplified", self.notes, calls
        check.kind_reason = self.kind_reason
        check.spec, check.w = Spec("simplified", x.shape[1], x.shape[1]), None
        check.causal_hint = False
        check.module = None
        check._invoke = self._invoke_plain
        if all(close(c.out, pipeline(c.x, check.spec, None)["output"]) for c in calls):
            return check._correct_or_unstable()
        return check._diagnose()

    def _invoke_plain(self, x32: torch.Tensor, causal_hint: bool = False):
        result, err = call_safely(self.tgt.obj, x32, timeout=self.timeout)
        if err is not None:
            return None, err
        return _first_tensor(result), None


_ = KINDS
