"""Probe a module: find its weights, call it the way it expects, record what it computes.

Calls are made on a batch of two different sequences and on each sequence alone (where
the module takes unbatched input); modules taking ``(query, key, value)``, tokens-first
``nn.MultiheadAttention`` and Hugging Face layers (which get their causal mask from the
model, so it is passed here the way the model passes it) are called accordingly. The kind,
when not given, is inferred from names, buffers and the module's behaviour.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ..errors import AttnScopeError, describe
from ..stages import Stage
from .binding import WEIGHT_HELP, Binding, bind
from .compare import close
from .judge import Call, Judge
from .record import Op, Recorder
from .reference import Spec, Weights
from .report import CheckReport
from .target import SIZES, Target, call_safely

__all__ = ["BATCH", "ModuleProbe", "first_tensor", "fmt_shape", "rebuild_sdpa"]

BATCH = 2
_WEIGHTLESS_WIDTH = 5  # d_in for a module without weights (simplified attention)


def first_tensor(result: object) -> object:
    """What a call returned, reduced to the attention output: the first element of a tuple
    or list, the first tensor of a dict (``{"out": ..., "attn": ...}``)."""
    if isinstance(result, (tuple, list)) and result:
        return result[0]
    if isinstance(result, dict):
        return next((v for v in result.values() if isinstance(v, torch.Tensor)), result)
    if hasattr(result, "to_tuple"):  # Hugging Face ModelOutput
        return result.to_tuple()[0]
    return result


def rebuild_sdpa(rec: Recorder) -> list[Op]:
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
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # fully masked rows: 0, as SDPA
        where = call.location
        name = "scaled_dot_product_attention (rebuilt from its arguments)"
        for t in (scores, scaled, logits, weights, call.output):
            ops.append(Op(name, t, where, -1))
    return ops


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


class ModuleProbe:
    """Everything about calling one module; :meth:`run` hands the calls to a :class:`Judge`."""

    def __init__(self, tgt: Target, kind, seed, timeout, weights, tokens=None):
        self.tgt, self.kind, self.timeout, self.weights = tgt, kind, timeout, weights
        self.fixed_tokens = tokens
        self.module: nn.Module = tgt.obj
        self.notes: list[str] = []
        self.kind_reason = ""
        self.causal_hint = False
        self.gen = torch.Generator().manual_seed(seed)

    def run(self) -> CheckReport:
        self.module.eval()
        binding = self._bind()
        self.binding = binding
        self.adapter = self._adapter()
        tokens = self._tokens(binding)
        widths = (
            [_WEIGHTLESS_WIDTH]
            if binding is None
            else sorted({c.q.shape[0] for c in binding.candidates}, key=lambda d: d != binding.d_in)
        )
        for i, d_in in enumerate(widths):
            x = torch.randn(BATCH, tokens, d_in, generator=self.gen)
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

    def _tokens(self, binding: Binding | None) -> int:
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        taken = {BATCH}
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
        # tokens first, (T, B, d): torch's default, and any module that says so
        seq_first = getattr(m, "batch_first", True) is False
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
        out = first_tensor(result)
        if not isinstance(out, torch.Tensor):
            raise AttnScopeError(
                f"{self.tgt.text}: expected the module to return a tensor (or a tuple whose first "
                f"element is one), got {describe(out)}"
            )
        if a["seq_first"] and batched and out.dim() == 3:
            out = out.transpose(0, 1)
        return out, None

    def _probe(self, x: torch.Tensor, causal_hint: bool = False) -> list[Call]:
        """Call batched, then each sequence alone; keep every call that works."""
        self.causal_hint = causal_hint
        calls: list[Call] = []
        errors = []
        rec = Recorder()
        with rec:
            out, err = self._invoke(x, causal_hint)
        if err is None:
            self._expect_shape(out, x)
            calls.append(Call(x.double(), out.double(), True, rec.ops, rebuild_sdpa(rec), rec.sdpa))
        else:
            errors.append(f"batched input {fmt_shape(x.shape)}: {err}")
        rec1 = Recorder()
        with rec1:
            out1, err1 = self._invoke(x[0], causal_hint)
        if err1 is None:
            self._expect_shape(out1, x[0])
            calls.append(
                Call(
                    x[:1].double(),
                    out1.double().unsqueeze(0),
                    False,
                    rec1.ops,
                    rebuild_sdpa(rec1),
                    rec1.sdpa,
                )
            )
        else:
            errors.append(f"unbatched input {fmt_shape(x[0].shape)}: {err1}")
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
                f"{fmt_shape((*x.shape[:-1], 'd_out'))}, got {describe(out)}"
            )

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

    def _short_probe(self) -> list[Call] | None:
        """The same calls on a short input (see :meth:`Judge._explain_quickly`)."""
        notes, fixed = list(self.notes), self.fixed_tokens
        self.fixed_tokens = None
        try:
            d_in = self.calls[0].x.shape[-1]
            x = torch.randn(BATCH, self._tokens(self.binding), d_in, generator=self.gen)
            return self._probe(x, self.causal_hint)
        except AttnScopeError:
            return None
        finally:
            self.notes, self.fixed_tokens = notes, fixed

    def _varies(self) -> tuple[Stage, str, str | None] | None:
        """Run the first call again: attention in eval mode must give the same output."""
        first = self.calls[0]
        rec = Recorder()
        with rec:
            out, err = self._invoke(
                first.x.float() if first.batched else first.x[0].float(), self.causal_hint
            )
        if err is not None:
            return None
        out = out.double() if first.batched else out.double().unsqueeze(0)
        if out.shape != first.out.shape or close(out, first.out, rtol=1e-6):
            return None  # the same, up to reductions that may run in another order
        dropout = [op for op in rec.ops if "dropout" in op.name]
        where = dropout[0].location if dropout else None
        stage = Stage.WEIGHTS if dropout else Stage.OUTPUT
        cause = "dropout that stays on in eval mode (F.dropout's training=True default?)"
        msg = (
            f"{stage.value}: the output changes from one run to the next on the same input, "
            f"in eval mode: {cause if dropout else 'something random in the computation'}. "
            "Expected a deterministic result once model.eval() is called"
        )
        if where:
            msg += f". Look at {where}"
        return stage, msg, where

    def _judge(self, options: list[tuple[Weights | None, Spec]]) -> CheckReport:
        judge = Judge(
            target=self.tgt.text,
            kind=self.kind,
            kind_reason=self.kind_reason,
            notes=self.notes,
            calls=self.calls,
            invoke=lambda x: self._invoke(x, self.causal_hint),
            reprobe=self._short_probe,
        )
        judge.varies = self._varies()
        return judge.run(options)
