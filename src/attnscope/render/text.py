"""Text rendering with rich: colour and tables on a terminal, plain text when piped.

``color=None`` means auto: colour when standard output is a terminal and ``NO_COLOR`` is
not set (https://no-color.org). Every function returns a string; the CLI prints it.
Rendering never computes attention: it formats what a trace, report or demo holds.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..checking.report import CheckReport, ModelReport
from ..display import renders
from ..formatting import format_number as _num
from ..formatting import format_values
from ..stages import MATRIX_STAGES
from ..trace import Trace
from .figures import key_labels, layer_features
from .heads import profile_heads

if TYPE_CHECKING:
    from ..lesson import DemoResult, Step

__all__ = [
    "use_color",
    "format_tensor",
    "format_values",
    "trace_text",
    "check_text",
    "demo_text",
    "step_text",
]

#: Tensors with more entries than this are summarised instead of printed.
MAX_VALUES = 144
_LABEL_WIDTH = 10


def use_color(color: bool | None = None, stream=None) -> bool:
    """Whether to colour: ``color`` when given, else a terminal without ``NO_COLOR``."""
    if color is not None:
        return bool(color)
    if os.environ.get("NO_COLOR"):
        return False
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class _Out:
    """A rich console writing to a string, styled only when colour is on."""

    def __init__(self, color: bool | None):
        self.color = use_color(color)
        width = shutil.get_terminal_size((100, 24)).columns if self.color else 160
        self.console = Console(
            file=io.StringIO(),
            force_terminal=self.color,
            no_color=not self.color,
            color_system="standard" if self.color else None,
            width=max(width, 60),
            highlight=False,
            force_jupyter=False,  # in a notebook too: a string, not display() calls
            emoji=False,
            markup=False,
        )

    def line(self, *parts: str | tuple[str, str]) -> None:
        """Print one line from plain strings and ``(text, style)`` pairs."""
        # soft_wrap: long lines stay whole (the terminal wraps them), never cut mid-indent.
        self.console.print(Text.assemble(*parts) if parts else Text(""), soft_wrap=True)

    def table(self, *columns: str) -> Table:
        # Plain output keeps the columns aligned but drops the box drawing.
        return Table(
            *columns,
            box=box.SIMPLE_HEAD if self.color else None,
            show_header=True,
            header_style="bold" if self.color else "",
            pad_edge=False,
        )

    def print(self, renderable) -> None:
        self.console.print(renderable)

    def text(self) -> str:
        raw = self.console.file.getvalue()  # type: ignore[attr-defined]
        return "\n".join(line.rstrip() for line in raw.splitlines()) + "\n"


def _verdict(ok: bool) -> tuple[str, str]:
    return ("pass", "green") if ok else ("FAIL", "bold red")


def _shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else str(tuple(shape))


def _label(text: str) -> str:
    return text if len(text) <= _LABEL_WIDTH else text[: _LABEL_WIDTH - 1] + "~"


def format_tensor(
    t: torch.Tensor,
    rows: Sequence[str] | None = None,
    cols: Sequence[str] | None = None,
    *,
    max_values: int = MAX_VALUES,
) -> str:
    """Values to 4 decimals: a 1-D tensor on one line, a 2-D one as labelled rows.

    Higher ranks print one matrix per leading index (``head 0:``, ...). Tensors with more
    than ``max_values`` entries are summarised by shape, min, max and mean.
    """
    t = t.detach().cpu().double()
    if t.numel() > max_values:
        finite = t[torch.isfinite(t)]
        if finite.numel() == 0:
            return f"{tuple(t.shape)}: no finite values"
        text = (
            f"{tuple(t.shape)}: min {_num(finite.min().item())}, max {_num(finite.max().item())}, "
            f"mean {_num(finite.mean().item())} (too large to print)"
        )
        # which rows and columns these are, in short lists (a long input's chosen rows, or
        # its words): positions 0, 1, 2, ... of every token go without saying
        if t.dim() >= 2 and _telling(rows, t.shape[-2]):
            text += f"; rows {_label_list(rows)}"
        if _telling(cols, t.shape[-1]):
            text += f"; columns {_label_list(cols)}"
        return text
    if t.dim() == 0:
        return _num(t.item())
    if t.dim() == 1:
        values = [_num(v) for v in t.tolist()]
        if cols is None:
            return "  ".join(values)
        width = max(max(len(v) for v in values), *(len(_label(c)) for c in cols))
        head = "  ".join(_label(c).rjust(width) for c in cols)
        return head + "\n" + "  ".join(v.rjust(width) for v in values)
    if t.dim() > 2:
        name = "head" if t.dim() == 3 else "index"
        return "\n".join(
            f"{name} {i}:\n" + format_tensor(t[i], rows, cols, max_values=max_values)
            for i in range(t.shape[0])
        )
    cells = [[_num(v) for v in row] for row in t.tolist()]
    width = max(len(c) for row in cells for c in row)
    if cols is not None and len(cols) == t.shape[1]:
        width = max(width, *(len(_label(c)) for c in cols))
    row_names = [_label(r) for r in rows] if rows is not None and len(rows) == t.shape[0] else None
    lead = max((len(r) for r in row_names), default=0) if row_names else 0
    lines = []
    if cols is not None and len(cols) == t.shape[1]:
        lines.append(
            " " * (lead + 2 if lead else 0) + "  ".join(_label(c).rjust(width) for c in cols)
        )
    for i, row in enumerate(cells):
        prefix = row_names[i].ljust(lead) + "  " if row_names else ""
        lines.append(prefix + "  ".join(c.rjust(width) for c in row))
    return "\n".join(lines)


def _telling(labels: Sequence[str] | None, size: int, most: int = 6) -> bool:
    """Whether ``labels`` of ``size`` entries say more than their positions."""
    if labels is None or len(labels) != size:
        return False
    return size <= most or any(str(label) != str(i) for i, label in enumerate(labels))


def _label_list(labels: Sequence[str], most: int = 6) -> str:
    """Labels for one line, comma-separated: all of them, or the first and last few of a
    long list (``Your, journey, starts, with, …, one, step (10,000 tokens)``)."""
    labels = [str(label) for label in labels]
    if len(labels) <= most:
        return ", ".join(labels)
    # what they count: tokens, unless every label is "<word> <number>" ("head 3")
    words = {label.partition(" ")[0] for label in labels}
    numbered = all(label.partition(" ")[2].isdigit() for label in labels)
    noun = f"{words.pop()}s" if len(words) == 1 and numbered else "tokens"
    head, tail = ", ".join(labels[: most - 2]), ", ".join(labels[-2:])
    return f"{head}, …, {tail} ({len(labels):,} {noun})"


def _block(out: _Out, name: str, text: str, indent: str = "  ") -> None:
    lines = text.splitlines() or [""]
    if len(lines) == 1:
        out.line(indent, (name, "cyan"), "  ", lines[0])
        return
    out.line(indent, (name, "cyan"))
    for line in lines:
        out.line(indent + "  ", line)


def _slice_for_display(tr: Trace, tensor: torch.Tensor, batch: int = 0) -> tuple[torch.Tensor, str]:
    if tr.dims.batch is not None:
        return tensor[batch], f" (batch {batch} of {tr.dims.batch})"
    return tensor, ""


@renders(Trace, "text")
def trace_text(
    trace: Trace,
    color: bool | None = None,
    *,
    token: int | None = None,
    checks: Sequence[tuple[str, bool, str]] | None = None,
    max_values: int = MAX_VALUES,
) -> str:
    """A trace as text: each stage's predicted shape and rule, actual shape, and values.

    Args:
        trace: what to show.
        color: see :func:`use_color`.
        token: when given, the single-query walk for that token, beside its batched row.
        checks: ``(name, ok, detail)`` rows to list at the end.
        max_values: tensors larger than this are summarised (per batch element).
    """
    out = _Out(color)
    dims = trace.dims
    module = type(trace.module).__name__ if trace.module is not None else "weightless"
    heads = f", {dims.num_heads} heads" if dims.num_heads else ""
    batch = f", batch {dims.batch}" if dims.batch is not None else ""
    out.line(
        ("attnscope trace", "bold"),
        f": {trace.kind} ({module}, d_in={dims.d_in}, d_out={dims.d_out}{heads}), "
        f"{dims.tokens} tokens{batch}",
    )
    features = layer_features(trace)
    if features:
        out.line("layer: ", "; ".join(features))
    out.line("tokens: ", short_labels(trace.labels))
    table = out.table("stage", "predicted", "actual", "", "rule")
    for c in trace.shape_checks():
        word, style = _verdict(c.ok)
        table.add_row(
            c.stage.value, _shape(c.predicted), _shape(c.actual), Text(word, style), c.rule
        )
    out.print(table)
    if trace.rows is not None:
        out.line("rows: ", ", ".join(f"{r} ({trace.labels[r]})" for r in trace.rows))
    for name, tensor in trace.stages.items():
        shown, where = _slice_for_display(trace, tensor)
        square = name in {s.value for s in MATRIX_STAGES}
        row_labels = trace.labels
        if square and trace.rows is not None:
            row_labels = tuple(trace.labels[r] for r in trace.rows)
        text = format_tensor(
            shown, row_labels, key_labels(trace) if square else None, max_values=max_values
        )
        out.line()
        _block(out, f"{name} {_shape(tensor.shape)}{where}", text)
    if trace.rows is not None:
        out.line()
        _summary(out, trace)
    if token is not None:
        walk = trace.walk(token)
        out.line()
        out.line(
            ("walk", "bold"), f": token {walk.token} ({walk.label!r}) alone, one query at a time"
        )
        names = ("query", "scores", "scaled_scores", "biased_scores", "masked_scores")
        for name in (*names, "weights", "context"):
            value = getattr(walk, name)
            if value is not None:
                keys = key_labels(trace)
                cols = keys if value.shape[-1] == len(keys) and name != "query" else None
                rows = [f"head {h}" for h in range(dims.num_heads)] if dims.num_heads else None
                _block(out, name, format_tensor(value, rows, cols, max_values=max_values))
        rows = [f"head {h}" for h in range(dims.num_heads)] if dims.num_heads else None
        _block(
            out,
            f"batched row {walk.token}",
            format_tensor(walk.batched_context, rows, max_values=max_values),
        )
        if checks is None:  # otherwise the checklist below says it
            word, style = _verdict(walk.matches)
            out.line(
                "  ",
                (word, style),
                f"  the single-token context equals row {walk.token} of the batched context "
                f"(max |difference| {walk.max_abs_diff:.1e})",
            )
    if checks:
        out.line()
        _checklist(out, checks)
    return out.text()


def _summary(out: _Out, trace: Trace, batch: int = 0) -> None:
    """A row trace's summaries of its chosen queries, per head: from the blockwise pass."""
    s = trace.summary
    if trace.dims.batch is not None:
        s = s.select(batch)
    heads = trace.dims.num_heads
    out.line(("summary", "bold"), ": each chosen query's weights, without the matrix")
    table = out.table(
        "query", "head", "entropy", "max weight (key)", "first token", "distance", "top keys"
    )
    for r in trace.rows:
        for h in range(heads or 1):
            one = s.select(h, r) if heads else s.select(r)
            top = ", ".join(
                f"{k} {w:.3f}"
                for k, w in zip(one.top_keys.tolist(), one.top_weights.tolist(), strict=True)
                if k >= 0
            )
            table.add_row(
                str(r) if trace.labels[r] == str(r) else f"{r} {trace.labels[r]}",
                "" if heads is None else str(h),
                f"{one.entropy.item():.3f}",
                f"{one.max_weight.item():.3f} ({one.max_key.item()})",
                f"{one.sink_weight.item():.3f}",
                f"{one.mean_distance.item():.1f}",
                top,
            )
    out.print(table)
    _standouts(out, trace, batch)


def _standouts(out: _Out, trace: Trace, batch: int = 0) -> None:
    """Every head averaged over its later queries, the ones that stand out named."""
    profiles = profile_heads(trace, batch)
    out.line()
    out.line(
        ("heads", "bold"),
        f": every query's summary, averaged over the later half ({trace.dims.tokens:,} "
        "tokens); spread is entropy over the uniform spread's",
    )
    table = out.table(
        "head", "entropy", "spread", "max weight", "first token", "distance", "stands out"
    )
    quiet = [p for p in profiles if not p.notes]
    shown = profiles if len(profiles) <= 16 else [p for p in profiles if p.notes]
    for p in shown:
        table.add_row(
            "" if p.head is None else str(p.head),
            f"{p.entropy:.3f}",
            f"{p.spread:.0%}",
            f"{p.max_weight:.3f}",
            f"{p.sink_weight:.3f}",
            f"{p.mean_distance:,.1f}",
            "; ".join(p.notes) or "-",
        )
    out.print(table)
    if len(shown) < len(profiles):
        out.line(f"  {len(quiet)} other heads: nothing stands out")


def _checklist(out: _Out, checks: Sequence[tuple[str, bool, str]]) -> None:
    for name, ok, detail in checks:
        word, style = _verdict(ok)
        out.line("  ", (word, style), "  ", name, (f"  ({detail})" if detail else "", "dim"))


@renders(CheckReport, "text")
def check_text(report: CheckReport, color: bool | None = None) -> str:
    """The check report as the seed's checklist.

    One row per stage in pipeline order with its predicted and actual shape, pass or FAIL
    and what was compared, stopping at the first failure; then the failure (stage, mistake
    code, where in the code), the kind with why it was inferred, and notes.
    """
    out = _Out(color)
    verdict = ("OK", "bold green") if report.ok else ("FAILED", "bold red")
    out.line(("attnscope check", "bold"), f": {report.target}  ", verdict)
    table = out.table("#", "stage", "predicted", "actual", "", "detail")
    for i, c in enumerate(report.checks, start=1):
        word, style = _verdict(c.ok)
        table.add_row(
            str(i),
            c.stage.value,
            _shape(c.predicted),
            _shape(c.actual),
            Text(word, style),
            c.detail,
        )
        if not c.ok:  # the seed's checklist: stop at the first checkpoint that fails
            break
    if report.checks:
        out.print(table)
    failure = report.first_failure
    if failure is not None:
        out.line()
        out.line(
            ("first failure", "bold red"),
            f": stage {failure.stage.value}, mistake ",
            (failure.mistake, "bold"),
        )
        out.line("  ", failure.message)
        if failure.location and failure.location not in failure.message:
            out.line("  at ", (failure.location, "cyan"))
    out.line()
    out.line(
        "kind: ", (report.kind, "bold"), f" ({report.kind_reason})" if report.kind_reason else ""
    )
    for note in report.notes:
        out.line("note: ", note)
    return out.text()


@renders(ModelReport, "text")
def model_text(report: ModelReport, color: bool | None = None) -> str:
    """A model's check: one line per attention layer in the order the model runs them, then
    the first failing layer's checklist."""
    out = _Out(color)
    verdict = ("OK", "bold green") if report.ok else ("FAILED", "bold red")
    out.line(("attnscope check", "bold"), f": {report.target}  ", verdict)
    table = out.table("layer", "kind", "heads", "", "first failure")
    for path, r in report.layers:
        s = r.structure or {}
        heads = f"{s.get('heads', '?')}/{s.get('kv_heads', '?')} kv" if s else "-"
        word, style = _verdict(r.ok)
        failure = r.first_failure
        table.add_row(
            path,
            r.kind,
            heads,
            Text(word, style),
            "" if failure is None else f"{failure.stage.value} / {failure.mistake}",
        )
    out.print(table)
    d = report.decode
    if d is not None:
        word, style = _verdict(d.ok)
        what = (
            f"{d.steps} cached steps equal the full pass"
            if d.ok
            else f"{d.mistake or 'no cache mistake named'} at step {d.step}: {d.message}"
        )
        how = f" ({d.protocol})" if getattr(d, "protocol", None) else ""
        out.line(f"decoding with its cache{how}: ", (word, style), "  ", what)
        if not d.ok and d.location and d.location not in d.message:
            out.line("  at ", (d.location, "cyan"))
    for note in report.notes:
        out.line("note: ", note)
    failing = next((r for _, r in report.layers if not r.ok), None)
    if failing is not None:
        out.line()
        out.line(("first failing layer", "bold red"), f": {report.first_layer}")
        return out.text() + check_text(failing, color=color)
    return out.text()


def step_text(step: Step, number: int | None = None, color: bool | None = None) -> str:
    """One demo step: what to predict, predicted vs actual shapes, the values, the checks."""
    out = _Out(color)
    _step(out, step, number)
    return out.text()


def _step(out: _Out, step: Step, number: int | None) -> None:
    head = f"{number}. " if number is not None else ""
    out.line((head + step.title, "bold"))
    before, sep, after = step.predict.partition("Predict:")
    out.line("   ", before, (sep, "yellow"), after)
    if step.shapes:
        table = out.table("   ", "shape of", "predicted", "actual", "", "rule")
        for s in step.shapes:
            word, style = _verdict(s.ok)
            table.add_row(
                "", s.name, _shape(s.predicted), _shape(s.actual), Text(word, style), s.rule
            )
        out.print(table)
    for shown in step.shown:
        _block(out, shown.name, format_tensor(shown.tensor, shown.rows, shown.cols), "   ")
    for check in step.checks:
        word, style = _verdict(check.ok)
        out.line("   ", (word, style), "  ", check.name, ("  (" + check.detail + ")", "dim"))


_PART_TITLES = {
    "simplified": "Simplified attention: no trainable weights",
    "self": "Self-attention with trainable weights: SelfAttentionV1",
    "causal": "Causal attention: no peeking at later tokens",
    "multihead": "Multi-head attention (causal=False: every token sees every token)",
    "causal-multihead": "Causal multi-head attention: the book's MultiHeadAttention",
    "rope": "Rotary position embeddings (RoPE): queries and keys turned by their position",
    "gqa": "Grouped-query attention: query heads share key/value heads (GroupedQueryAttention)",
}


def short_labels(labels: list[str], most: int = 12) -> str:
    """Token labels for one line: all of them, or the first and last few of a long input
    (``Your journey starts ... step (10,000 tokens)``)."""
    if len(labels) <= most:
        return " ".join(labels)
    head, tail = labels[: most - 3], labels[-2:]
    return f"{' '.join(head)} ... {' '.join(tail)} ({len(labels):,} tokens)"


def demo_text(result: DemoResult, color: bool | None = None) -> str:
    """The whole demo: parts in order, each step predict-then-check, then a summary."""
    out = _Out(color)
    out.line(("attnscope demo", "bold"), ": predict each result, then check it.")
    tokens = next(iter(result.traces.values())).labels
    out.line(
        "input: ",
        short_labels(tokens),
        f"  (query: token {result.token}, {tokens[result.token]!r})",
    )
    part = None
    for number, step in enumerate(result.steps, start=1):
        if step.part != part:
            part = step.part
            out.line()
            out.line((f"== {_PART_TITLES.get(part, part)} ==", "bold magenta"))
        out.line()
        _step(out, step, number)
    checks = result.checks
    failed = [c for c in checks if not c.ok]
    out.line()
    if failed:
        out.line(("FAIL", "bold red"), f": {len(failed)} of {len(checks)} checks failed:")
        for c in failed:
            out.line("  ", c.name, ("  (" + c.detail + ")", "dim"))
    else:
        out.line(("pass", "bold green"), f": all {len(checks)} checks passed.")
    return out.text()
