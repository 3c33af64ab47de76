"""`attnscope check`: load a target, probe it, judge it, report.

Modules are probed by :class:`.probe.ModuleProbe`; plain functions (kinds ``scores`` and
``simplified``) are called here. Both are judged against the float64 reference
(:mod:`.judge`), which names the first stage that goes wrong and the mistake.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
from collections.abc import Iterator

import torch

from ..errors import AttnScopeError, describe
from ..stages import Dims, Kind, Stage
from .compare import close, find_stage
from .decode import PROTOCOLS
from .judge import Call, Judge
from .mistakes import MISTAKES, one_query_mutations
from .model import check_model, token_vocabulary
from .probe import ModuleProbe, first_tensor, fmt_shape, rebuild_sdpa
from .record import Recorder
from .reference import Spec
from .report import CheckReport, Failure, single_head
from .structure import SeveralLayers
from .target import SIZES, Target, call_safely, load

__all__ = ["check", "DEFAULT_TIMEOUT"]

#: seconds one call of the target may take before the check gives up (0 or None: no limit)
DEFAULT_TIMEOUT = 60.0


def check(
    target: str | object,
    *,
    kind: str | None = None,
    init: dict | None = None,
    seed: int = 0,
    timeout: float | None = DEFAULT_TIMEOUT,
    weights: dict[str, str] | None = None,
    tokens: int | None = None,
    decode: str | None = None,
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
        timeout: seconds each call of the target (and its import and construction) may
            take; 0 or None for no limit.
        weights: roles to parameter/submodule paths (``{"query": "W_q", ...}``) where the
            weights cannot be found by their names.
        tokens: probe length; by default a small number that differs from every size.
        decode: a whole model only: how to drive its key/value cache for the decoding
            check, ``"hf"`` (``use_cache`` and ``past_key_values``), ``"buffers"``
            (``use_cache`` and ``reset_kv_cache()``, the cache kept in the model),
            ``"cache"`` (a KVCache passed as ``cache=``), or ``"none"`` to skip it; by
            default read from the model's forward.

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
    if decode is not None and decode not in PROTOCOLS:
        raise AttnScopeError(f"--decode: expected one of {', '.join(PROTOCOLS)}, got {decode!r}")
    timeout = timeout or None
    with _threads(1 if tokens is None or tokens <= _SMALL_PROBE else None):
        tgt = load(target, kind=kind, init=init, seed=seed, tokens=tokens, timeout=timeout)
        tgt = _in_float32(tgt)
        if tgt.is_module:
            _out_of_inference_mode(tgt)
        try:
            if tgt.is_module:
                try:
                    report = ModuleProbe(tgt, kind, seed, timeout, weights, tokens).run()
                    return _not_decoded(report, tgt, decode)
                except AttnScopeError as exc:
                    if _a_model(tgt, exc):
                        second = getattr(exc, "second", None)
                        return check_model(tgt, seed, timeout, tokens, kind, decode, second)
                    own = _with_its_defaults(tgt, init, seed, exc)
                    if own is None:
                        raise
                    first = exc
                try:
                    report = ModuleProbe(own, kind, seed, timeout, weights, tokens).run()
                except AttnScopeError:
                    raise first from None
                return _not_decoded(report, tgt, decode)
            return _not_decoded(_FunctionCheck(tgt, kind, seed, timeout).run(), tgt, decode)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            if isinstance(exc, AttnScopeError):
                raise
            # the target ran; reading it failed in a way attnscope did not foresee
            raise AttnScopeError(
                f"{tgt.text}: the check could not be completed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); naming the weights with "
                "--weights or the kind with --kind may help, and this is worth reporting"
            ) from exc


def _out_of_inference_mode(tgt: Target) -> None:
    """Forwards decorated with ``torch.inference_mode`` (Meta's Llama) run without it: its
    tensors keep no version counter, and the record needs one. Said in the notes."""
    undone = []
    for path, m in tgt.obj.named_modules():
        forward = type(m).forward
        cells = [c.cell_contents for c in getattr(forward, "__closure__", None) or ()]
        if hasattr(forward, "__wrapped__") and any(
            isinstance(getattr(c, "__self__", c), torch.inference_mode) for c in cells
        ):
            m.forward = types.MethodType(forward.__wrapped__, m)
            undone.append(path or type(m).__name__)
    if undone:
        tgt.notes.append(
            f"checked without the torch.inference_mode that decorates {', '.join(undone)}'s "
            "forward (inference tensors cannot be recorded)"
        )


def _not_decoded(report: CheckReport, tgt, decode: str | None) -> CheckReport:
    """A single layer's report; ``decode`` asks for a whole model's cache, which it has not."""
    if decode not in (None, "none"):
        raise AttnScopeError(
            f"--decode {decode}: expected a whole model (token ids in, its attention layers "
            f"and their key/value cache); {tgt.text} is one attention layer"
        )
    return report


def _with_its_defaults(tgt, init, seed: int, exc: AttnScopeError):
    """A class built from sizes attnscope picked that do not fit together (its code raised on
    every probe), built again from its own defaults, where it has one for everything."""
    raised = "raised on every probe" in str(exc) or "Every probe raised" in str(exc)
    if tgt.origin != "class" or init is not None or not raised:
        return None
    cls = type(tgt.obj)
    try:
        sig = inspect.signature(cls.__init__)
        if any(
            p.default is inspect.Parameter.empty
            for n, p in sig.parameters.items()
            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ):
            return None
        torch.manual_seed(seed)
        module = cls()
    except Exception:  # its own defaults do not build either: the first error stands
        return None
    note = (
        f"built with its own defaults: the sizes attnscope picks ({tgt.init}) do not fit "
        "together in it"
    )
    return Target(module, tgt.text, "class", {}, [*tgt.notes, note])


def _in_float32(tgt: Target) -> Target:
    """A module whose weights are all in another floating type (bfloat16 or float16, as
    checkpoints are loaded; float64) is checked on a float32 copy: the probes are float32,
    and half-precision weights convert exactly. The target itself is left as it is."""
    if not tgt.is_module:
        return tgt
    types = {p.dtype for p in tgt.obj.parameters() if p.is_floating_point()}
    if len(types) != 1 or torch.float32 in types:
        return tgt
    (dtype,) = types
    try:
        module = copy.deepcopy(tgt.obj).float()
    except Exception:  # a module that cannot be copied: checked as it is (and says why)
        return tgt
    exact = "exactly" if dtype in (torch.bfloat16, torch.float16) else "rounded"
    note = (
        f"checked in float32: its weights are {str(dtype).removeprefix('torch.')}, converted "
        f"{exact} on a copy"
    )
    return Target(module, tgt.text, tgt.origin, tgt.init, [*tgt.notes, note])


def _a_model(tgt, exc: AttnScopeError) -> bool:
    """Whether a target the single-layer check could not take is a model: several
    attention layers in a row, or token ids in (an embedding table first)."""
    if isinstance(exc, SeveralLayers):
        return True
    raised = "raised on every probe" in str(exc) or "Every probe raised" in str(exc)
    return token_vocabulary(tgt.obj) is not None and raised


_SMALL_PROBE = 32  # tokens; below this one thread is as fast, and far faster on a busy CPU


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads, then restore. The default probe is tiny: a second
    thread only waits on the first, and on a loaded machine that wait costs 3-10x."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _FunctionCheck:
    """A plain function: ``f(inputs, query_index)`` (scores) or ``f(inputs)`` (simplified)."""

    def __init__(self, tgt: Target, kind, seed, timeout):
        self.tgt, self.timeout = tgt, timeout
        self.kind = None if kind is None else Kind.of(kind)
        self.notes: list[str] = []
        self.kind_reason = ""
        self.gen = torch.Generator().manual_seed(seed)

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
                    Kind.of("scores"),
                    "a function of two arguments f(inputs, query_index)",
                )
            else:
                self.kind = Kind.of("simplified")
                self.kind_reason = "a function of one argument f(inputs)"
        else:
            self.kind_reason = "given (--kind, or kind= from Python)"
        if self.kind.weighted:
            raise AttnScopeError(
                f"--kind {self.kind}: expected a module (class, instance or factory) for this "
                f"kind; a plain function can be checked as 'scores' or 'simplified'"
            )
        tokens, d = SIZES["tokens"], 5
        x = torch.randn(tokens, d, generator=self.gen)
        report = self._scores(x) if self.kind.one_query else self._simplified(x)
        report.structure = single_head(d)
        return report

    def _judge(self, calls: list[Call]) -> Judge:
        return Judge(
            target=self.tgt.text,
            kind=self.kind,
            kind_reason=self.kind_reason,
            notes=self.notes,
            calls=calls,
            invoke=self._invoke,
        )

    def _scores(self, x: torch.Tensor) -> CheckReport:
        n = x.shape[0]
        asked = [1, 0, n - 1, 4]
        queries, outs, recs, errors = [], [], [], []
        for i in asked:
            rec = Recorder()
            with rec:
                result, err = call_safely(self.tgt.obj, x, i, timeout=self.timeout)
            if err is not None:  # e.g. an index shifted past the end: judge the others
                errors.append(f"query_index={i}: {err}")
                continue
            out = first_tensor(result)
            if not isinstance(out, torch.Tensor):
                raise AttnScopeError(f"{self.tgt.text}: expected a tensor, got {describe(out)}")
            if out.shape != (n,):
                out = out.reshape(-1) if out.numel() == n else out
            if out.shape != (n,) or not out.is_floating_point():
                raise AttnScopeError(
                    f"{self.tgt.text}: expected one score per token, shape ({n},), got "
                    f"{describe(out)}"
                )
            outs.append(out.double())
            recs.append(rec)
            queries.append(i)
        if len(queries) < 2:
            raise AttnScopeError(f"{self.tgt.text} raised on the probes: " + "; ".join(errors))
        if errors:
            self.notes.append("raised for some query indices: " + "; ".join(errors))
        x64 = x.double()
        dims = Dims(tokens=n, d_in=x.shape[1], d_out=x.shape[1], one_query=True)
        refs = {Stage.QUERY: x64[queries[0]], Stage.SCORES: x64 @ x64[queries[0]]}
        ops = recs[0].ops
        found = {
            Stage.QUERY: find_stage(ops, Stage.QUERY, refs[Stage.QUERY], batched=False),
            Stage.SCORES: find_stage(ops, Stage.SCORES, refs[Stage.SCORES], batched=False),
        }
        if all(close(o, x64 @ x64[i]) for o, i in zip(outs, queries, strict=True)):
            return self._judge([])._report(None, found, refs, dims)
        used = [self._query_index_used(x64, o) for o in outs]
        if None not in used:  # every call scored exactly some token: the wrong one
            pairs = ", ".join(f"{i} -> {j}" for i, j in zip(queries, used, strict=True))
            where = self._scores_where(ops, Stage.QUERY, x64[used[0]])
            m = MISTAKES["wrong_query_token"]
            msg = (
                f"query: {m.meaning}: query_index -> the token actually used: {pairs}. "
                f"{m.one_query_expected}"
            )
            if where:
                msg += f". Look at {where}"
            failure = Failure(Stage.QUERY, "wrong_query_token", msg, where)
            return self._judge([])._report(failure, found, refs, dims, x64[used[0]])
        for code, stage, label, fn in one_query_mutations():
            try:
                predicted = [fn(x64, i) for i in queries]
            except (RuntimeError, IndexError):
                continue
            if all(close(o, p) for o, p in zip(outs, predicted, strict=True)):
                user = predicted[0]
                where = self._scores_where(ops, stage, user)
                m = MISTAKES[code]
                msg = f"{stage.value}: {m.meaning}: found {label}. {m.one_query_expected}"
                if where:
                    msg += f". Look at {where}"
                return self._judge([])._report(
                    Failure(stage, code, msg, where), found, refs, dims, user
                )
        stage = Stage.QUERY if found[Stage.QUERY] is None else Stage.SCORES
        msg = (
            f"{stage.value}: the scores differ from inputs @ inputs[query_index], and no "
            "known mistake explains them"
        )
        return self._judge([])._report(
            Failure(stage, "other", msg, None), found, refs, dims, outs[0]
        )

    def _query_index_used(self, x64: torch.Tensor, out: torch.Tensor) -> int | None:
        """The token whose dot products with every input are ``out``, if there is one."""
        for j in range(x64.shape[0]):
            if close(out, x64 @ x64[j]):
                return j
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
            out = first_tensor(result)
            if not isinstance(out, torch.Tensor) or out.shape != inp.shape:
                raise AttnScopeError(
                    f"{self.tgt.text}: expected context vectors of the input's shape "
                    f"{fmt_shape(inp.shape)}, got {describe(out)}"
                )
            x3 = inp.double() if batched else inp.double().unsqueeze(0)
            o3 = out.double() if batched else out.double().unsqueeze(0)
            calls.append(Call(x3, o3, batched, rec.ops, rebuild_sdpa(rec)))
        if not calls:
            raise AttnScopeError(f"{self.tgt.text} raised on every probe: " + "; ".join(errors))
        if len(calls) == 1:
            which = "batched" if calls[0].batched else "unbatched"
            self.notes.append(f"accepts only {which} input ({errors[0]})")
        d = x.shape[1]
        return self._judge(calls).run([(None, Spec(self.kind, d, d))])

    def _invoke(self, x32: torch.Tensor):
        result, err = call_safely(self.tgt.obj, x32, timeout=self.timeout)
        if err is not None:
            return None, err
        return first_tensor(result), None
