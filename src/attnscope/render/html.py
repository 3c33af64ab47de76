"""Self-contained HTML reports of a trace or a check, for files and notebooks.

A report needs no network: no CDN, no web fonts, no scripts at all. Figures are PNGs
embedded as ``data:`` URIs (inline SVGs from matplotlib would share element ids and clip
each other). Without matplotlib the matrices are drawn as coloured HTML tables instead.

Everything that can come from a user (token labels, target names, messages quoting code,
file locations) goes through :func:`html.escape`; written pages also carry a
Content-Security-Policy that forbids scripts, so a label like ``<script>alert(1)</script>``
shows as text and runs nothing.

``path=None`` returns a ``<div>`` fragment with scoped styles (what notebooks display via
``_repr_html_``); with a ``path`` the file is a full ``<!doctype html>`` page.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .._version import __version__
from ..checking.report import CheckReport, ModelReport
from ..display import renders
from ..errors import AttnScopeError
from ..stages import Stage
from ..trace import Trace
from .figures import (
    MATRIX_STAGES,
    Panel,
    _require_matplotlib,
    alibi_slopes_of,
    draw_heatmap,
    figure_bytes,
    key_labels,
    layer_features,
    masked_note_of,
    matrix_figure,
    panels_of,
    pipeline_figure,
    query_labels,
    refuse_existing,
    slope_text,
    summary_figure,
    trace_name,
    value_range,
    window_of,
)
from .files import write_output
from .heads import profile_heads

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..checking.report import StageCheck
    from ..trace import QueryWalk

__all__ = ["trace_html", "check_html"]

#: Matrices up to this size are also written out as coloured tables of numbers.
TABLE_MAX = 12
#: Beyond this many tokens, per-key tables (the walk, the no-matplotlib heatmaps) would be
#: too wide to read, and are left out.
LIST_MAX = 32
#: Resolution of embedded figures: sharp on high-density screens.
_DPI = 144

_CSS = """
.attnscope{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 color:#1f2328;background:#fff;max-width:1200px;padding:8px 4px}
.attnscope h1{font-size:1.45em;margin:.2em 0 .4em}
.attnscope h2{font-size:1.15em;margin:1.4em 0 .5em;border-bottom:1px solid #d8dee4;
 padding-bottom:.2em}
.attnscope h3{font-size:1em;margin:1em 0 .4em}
.attnscope .meta{color:#57606a;margin:.2em 0}
.attnscope code,.attnscope .num{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,
 monospace;font-size:.92em}
.attnscope table{border-collapse:collapse;margin:.4em 0}
.attnscope th,.attnscope td{border:1px solid #d8dee4;padding:3px 8px;text-align:left;
 vertical-align:top}
.attnscope th{background:#f6f8fa}
.attnscope td.num,.attnscope table.matrix td{text-align:right;white-space:nowrap}
.attnscope table.matrix td,.attnscope table.matrix th{padding:2px 6px;font-size:.85em}
.attnscope table.matrix td.masked{background:repeating-linear-gradient(45deg,#e4e4e4 0 4px,
 #cfcfcf 4px 6px);color:#444}
.attnscope .pass{color:#1a7f37;font-weight:600;white-space:nowrap}
.attnscope .fail{color:#cf222e;font-weight:600;white-space:nowrap}
.attnscope tr.failing td{background:#ffebe9}
.attnscope .verdict{font-size:1.1em;padding:.5em .8em;border-radius:6px;margin:.6em 0}
.attnscope .verdict.ok{background:#dafbe1;border:1px solid #4ac26b}
.attnscope .verdict.bad{background:#ffebe9;border:1px solid #ff8182}
.attnscope .failure{border:2px solid #cf222e;border-radius:8px;padding:.3em 1em 1em;
 background:#fff8f7;margin:1em 0}
.attnscope .failure h2{border-bottom-color:#ffcecb;color:#cf222e}
.attnscope .message{font-size:1.05em;margin:.4em 0}
.attnscope .side{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}
.attnscope .side>div{min-width:0}
.attnscope figure{margin:.6em 0 1.2em;max-width:100%}
.attnscope .figures{display:flex;flex-wrap:wrap;gap:8px 28px;align-items:flex-start}
.attnscope figure img{max-width:100%;height:auto;display:block}
.attnscope figcaption{color:#57606a;font-size:.9em;margin-top:.2em}
.attnscope .note{color:#57606a;font-style:italic}
"""

# Colour ramps for the tables (no matplotlib needed): viridis, Blues, and red-blue.
_RAMPS = {
    "values": ["#440154", "#3b528b", "#21918c", "#5ec962", "#fde725"],
    "weights": ["#f7fbff", "#c6dbef", "#6baed6", "#2171b5", "#08306b"],
    "diff": ["#2166ac", "#92c5de", "#f7f7f7", "#f4a582", "#b2182b"],
}


# --- small pieces ---------------------------------------------------------------------------


def _shape(shape: Iterable[int] | None) -> str:
    return "—" if shape is None else escape(str(tuple(shape)))


def _verdict(ok: bool) -> str:
    return '<span class="pass">✓ pass</span>' if ok else '<span class="fail">✗ fail</span>'


def _num(value: float, digits: int = 4) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "−inf" if value < 0 else "inf"
    if abs(value) >= 1e5:  # fill values like -1e9 would swamp the column
        return f"{value:.3g}"
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def _ramp(group: str, t: float) -> str:
    """The colour at ``t`` in [0, 1] along the group's ramp, as ``#rrggbb``."""
    stops = _RAMPS.get(group, _RAMPS["values"])
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    a, b = stops[i], stops[i + 1]
    mix = [
        round(int(a[k : k + 2], 16) * (1 - (t - i)) + int(b[k : k + 2], 16) * (t - i))
        for k in (1, 3, 5)
    ]
    return "#" + "".join(f"{c:02x}" for c in mix)


def _ink(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[k : k + 2], 16) / 255 for k in (1, 3, 5))
    return "#000" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.5 else "#fff"


def _matrix_table(
    values: np.ndarray,
    *,
    rows: Sequence[str] | None = None,
    cols: Sequence[str] | None = None,
    group: str = "values",
    mask: np.ndarray | None = None,
    digits: int = 4,
    bounds: tuple[float, float] | None = None,
) -> str:
    """A matrix as a table of numbers on their colours; masked cells hatched grey.

    ``group`` picks the colours: ``"values"`` (viridis), ``"weights"`` (blues from 0),
    ``"diff"`` (blue-white-red around 0) or ``"plain"`` (none).
    """
    values = np.atleast_2d(np.asarray(values, dtype=np.float64))
    mask = ~np.isfinite(values) if mask is None else np.asarray(mask, bool) | ~np.isfinite(values)
    lo, hi = bounds or value_range(np.where(mask, np.nan, values), group)
    n_rows, n_cols = values.shape
    rows = [str(i) for i in range(n_rows)] if rows is None else rows
    cols = [str(i) for i in range(n_cols)] if cols is None else cols
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    out = [f'<table class="matrix"><tr><th></th>{head}</tr>']
    for r in range(n_rows):
        cells = []
        for c in range(n_cols):
            v = float(values[r, c])
            if mask[r, c]:
                text = _num(v, digits) if not math.isfinite(v) else ""
                cells.append(f'<td class="masked" title="masked">{text}</td>')
            elif group == "plain":
                cells.append(f"<td>{_num(v, digits)}</td>")
            else:
                bg = _ramp(group, (v - lo) / (hi - lo))
                style = f"background:{bg};color:{_ink(bg)}"
                cells.append(f'<td style="{style}">{_num(v, digits)}</td>')
        out.append(f"<tr><th>{escape(rows[r])}</th>{''.join(cells)}</tr>")
    out.append("</table>")
    return "".join(out)


def _png_size(data: bytes) -> tuple[int, int]:
    # A PNG's IHDR chunk holds width and height at bytes 16..24.
    return struct.unpack(">II", data[16:24])


def _figure(fig: Figure, alt: str, css_class: str, caption: str = "") -> str:
    """A ``<figure>`` holding ``fig`` as a base64 PNG ``<img>``; ``caption`` is HTML."""
    data = figure_bytes(fig, "png", dpi=_DPI)
    # Shown at 88 CSS pixels per figure inch (a CSS inch is 96): two 6-token heatmaps fit
    # side by side in the report's 1200 pixels. The figure gets the image's width so a
    # long caption wraps under it instead of widening it.
    width = round(_png_size(data)[0] * 88 / _DPI)
    src = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    img = f'<img class="{css_class}" alt="{escape(alt)}" width="{width}" src="{src}">'
    caption = f"<figcaption>{caption}</figcaption>" if caption else ""
    return f'<figure style="width:{width}px">{img}{caption}</figure>'


def _figures_available() -> bool:
    try:
        _require_matplotlib()
    except AttnScopeError:
        return False
    return True


def _page(body: str, title: str, full_page: bool) -> str:
    div = f'<div class="attnscope"><style>{_CSS}</style>\n{body}\n</div>'
    if not full_page:
        return div
    # The policy allows inline styles and data: images only: no script, font or fetch.
    csp = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta name="generator" content="attnscope {escape(__version__)}">\n'
        f"<title>{escape(title)}</title>\n</head>\n<body>\n{div}\n</body>\n</html>\n"
    )


def _finish(text: str, path: str | Path | None, overwrite: bool) -> str:
    if path is not None:
        write_output(path, text, overwrite=overwrite)
    return text


# --- trace report ---------------------------------------------------------------------------


def _stage_table(trace: Trace) -> str:
    rows = [
        '<table class="stages"><tr><th>stage</th><th>rule</th><th>predicted shape</th>'
        "<th>actual shape</th><th>result</th></tr>"
    ]
    for c in trace.shape_checks():
        cls = "" if c.ok else ' class="failing"'
        rows.append(
            f"<tr{cls}><td><code>{c.stage.value}</code></td><td>{escape(c.rule)}</td>"
            f'<td class="num">{_shape(c.predicted)}</td><td class="num">{_shape(c.actual)}</td>'
            f"<td>{_verdict(c.ok)}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _checks_table(checks: Iterable[tuple[str, bool, str]]) -> str:
    rows = ['<table class="checks"><tr><th>check</th><th>result</th><th>detail</th></tr>']
    for name, ok, detail in checks:
        cls = "" if ok else ' class="failing"'
        rows.append(
            f"<tr{cls}><td>{escape(str(name))}</td><td>{_verdict(bool(ok))}</td>"
            f"<td>{escape(str(detail))}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _stage_note(trace: Trace, st: Stage) -> str:
    """What a heatmap of ``st`` shows beyond its rule: the ALiBi bias and the window's
    hidden cells (plain text; escape it)."""
    notes = []
    slopes = alibi_slopes_of(trace)
    if slopes is not None and st is Stage.BIASED_SCORES:
        listed = ", ".join(slope_text(v) for v in slopes)
        notes.append(
            f"ALiBi: head h adds −slope_h × |query − key| to its scaled scores, slopes {listed}"
        )
    elif slopes is not None and st.order > Stage.BIASED_SCORES.order:
        notes.append("the ALiBi bias included")
    if window_of(trace) is not None and st in (Stage.MASKED_SCORES, Stage.WEIGHTS):
        notes.append("hatched: " + masked_note_of(trace, st).split(": ", 1)[1])
    return "; ".join(notes)


def _heatmaps(trace: Trace, figures: bool) -> str:
    tokens = trace.dims.tokens
    cell = (1, 1) if min(tokens, len(key_labels(trace))) >= 2 else None
    if trace.rows is not None:  # a row trace: no fixed cell to outline
        cell = None
    first = None if trace.dims.batch is None else 0  # pictures show sequence 0
    parts = []
    if figures:
        if cell is not None:
            parts.append(
                '<p class="note">The outlined cell is the second query (row 1) against key 1, '
                "the score the walk below computes by hand.</p>"
            )
        parts.append('<div class="figures">')
        for st in MATRIX_STAGES:
            if st.value in trace:
                fig = draw_heatmap(trace, st, cell, first)
                note = _stage_note(trace, st)
                caption = (
                    f"<code>{st.value}</code>: rows are queries, columns are keys; "
                    f"{escape(st.rule)}" + (f"; {escape(note)}." if note else ".")
                )
                parts.append(_figure(fig, f"heatmap of {st.value}", "heatmap", caption))
        parts.append("</div>")
        return "".join(parts)
    parts.append(
        '<p class="note">matplotlib is not installed (pip install attnscope[plot]): '
        "matrices shown as tables.</p>"
    )
    if trace.dims.tokens > LIST_MAX:
        parts.append(f'<p class="note">{trace.dims.tokens} tokens: too many for tables.</p>')
        return "".join(parts)
    for st in MATRIX_STAGES:
        if st.value not in trace:
            continue
        for panel in panels_of(trace, st, first):
            title = st.value + (f", {panel.title}" if panel.title else "")
            table = _matrix_table(
                panel.values,
                rows=query_labels(trace),
                cols=key_labels(trace),
                group="weights" if st is Stage.WEIGHTS else "values",
                mask=panel.mask,
            )
            parts.append(f"<h3><code>{escape(title)}</code> (rows: queries, columns: keys)</h3>")
            note = _stage_note(trace, st)
            if note:
                parts.append(f'<p class="note">{escape(note)}</p>')
            parts.append(table)
    return "".join(parts)


def _summaries(trace: Trace, figures: bool) -> str:
    """Every query's summary: entropy and first-token weight per head over positions, and
    the heads that stand out."""
    parts = [
        "<h2>Every query, summarised</h2>",
        '<p class="meta">From the same blockwise pass as the context: no tokens × tokens '
        "matrix. Heads are averaged over the later half of the queries; spread is the "
        "entropy as a share of a uniform spread's.</p>",
    ]
    if figures:
        caption = "Entropy (left) and weight on the first token (right), one line per head"
        if trace.dims.batch is not None:
            caption += " (sequence 0)"
        fig = summary_figure(trace)
        parts.append(_figure(fig, "entropy per head over positions", "summary", caption))
    rows = [
        '<table class="heads"><tr><th>head</th><th>entropy</th><th>spread</th>'
        "<th>max weight</th><th>first token</th><th>distance</th><th>stands out</th></tr>"
    ]
    for p in profile_heads(trace):
        rows.append(
            f"<tr><td>{'' if p.head is None else p.head}</td><td>{p.entropy:.3f}</td>"
            f"<td>{p.spread:.0%}</td><td>{p.max_weight:.3f}</td><td>{p.sink_weight:.3f}</td>"
            f"<td>{p.mean_distance:,.1f}</td><td>{escape('; '.join(p.notes) or '-')}</td></tr>"
        )
    rows.append("</table>")
    return "".join(parts + rows)


def _rows(vec: torch.Tensor | None, name: str, width: int) -> list[tuple[str, np.ndarray]]:
    """A walk vector as named rows: ``(d,)`` is one row, ``(H, d)`` one row per head."""
    if vec is None:
        return []
    rows = vec.detach().to("cpu", torch.float64).reshape(-1, width).numpy()
    if len(rows) == 1:
        return [(name, rows[0])]
    return [(f"{name}, head {h}", row) for h, row in enumerate(rows)]


def _per_key_table(w: QueryWalk, labels: Sequence[str]) -> str:
    """One query's scores, scaled, biased and masked scores and weights, one column per key."""
    t = len(labels)
    per_key = [
        *_rows(w.scores, "scores", t),
        *_rows(w.scaled_scores, "scaled_scores", t),
        *_rows(w.biased_scores, "biased_scores", t),
        *_rows(w.masked_scores, "masked_scores", t),
    ]
    weights = _rows(w.weights, "weights", t)
    hidden = np.zeros((len(per_key) + len(weights), t), bool)
    if w.masked_scores is not None:  # zero weights of masked keys are drawn as masked
        hidden[len(per_key) :] = torch.isneginf(w.masked_scores).reshape(-1, t).numpy()
    per_key += weights
    return _matrix_table(
        np.stack([v for _, v in per_key]),
        rows=[n for n, _ in per_key],
        cols=labels,
        group="plain",
        mask=hidden,
    )


def _walk(trace: Trace, w: QueryWalk) -> str:
    """The seed's single-query computation for one token, step by step."""
    t = len(key_labels(trace))
    keys_table = f'<p class="note">{t} keys: too many to list; see the heatmaps.</p>'
    if t <= LIST_MAX:
        keys_table = _per_key_table(w, key_labels(trace))
    width = w.context.shape[-1]
    vectors = [
        *_rows(w.context, "context of this query alone", width),
        *_rows(w.batched_context, f"row {w.token} of the batched context", width),
    ]
    query = _rows(w.query, "query", w.query.shape[-1])
    return "".join(
        [
            f"<h2>Single query: token {w.token} “{escape(w.label)}”</h2>",
            '<p class="meta">The query is projected from this token alone, scored against '
            "every key, normalised, and used to weight the values; its context must equal "
            f"row {w.token} of the batched context.</p>",
            _matrix_table(
                np.stack([v for _, v in query]), rows=[n for n, _ in query], group="plain"
            ),
            "<h3>This query against every key</h3>",
            keys_table,
            "<h3>Its context vector</h3>",
            _matrix_table(
                np.stack([v for _, v in vectors]), rows=[n for n, _ in vectors], group="plain"
            ),
            f"<p>{_verdict(w.matches)}: the single-query context "
            f"{'matches' if w.matches else 'does not match'} row {w.token} of the batched context "
            f"(largest difference {w.max_abs_diff:.1e}).</p>",
        ]
    )


@renders(Trace, "html")
def trace_html(
    trace: Trace,
    path: str | Path | None = None,
    *,
    checks: Iterable[tuple[str, bool, str]] | None = None,
    title: str | None = None,
    overwrite: bool = False,
    full_page: bool | None = None,
    token: int | None = 1,
) -> str:
    """A self-contained HTML report of a trace.

    Shows the stages table (stage, rule, predicted and actual shape, pass/fail), the
    optional ``checks``, the pipeline figure, a heatmap of every ``(T, T)`` stage and the
    single-query walk for ``token``.

    Args:
        trace: a :class:`~attnscope.Trace`.
        path: write the page there (refusing to replace a file unless ``overwrite``).
        checks: ``(name, ok, detail)`` rows to show above the stages, e.g. the demo's.
        title: the page title (default names the module and kind).
        token: the query of the single-query walk (default 1, the seed's second token; a
            one-token trace has none, so then the walk is left out); ``None`` leaves it out.
        full_page: a whole ``<!doctype html>`` page (default: when ``path`` is given) or a
            ``<div>`` fragment for notebooks.

    Returns:
        the HTML text.
    """
    refuse_existing(path, overwrite)
    if token == 1 and trace.rows is not None:
        token = trace.rows[0]  # a row trace walks its first chosen query
    elif token == 1 and trace.dims.tokens < 2:
        token = None  # the default query does not exist: no walk
    walk = None if token is None else trace.walk(token)  # checks token, once
    if full_page is None:
        full_page = path is not None
    title = title or f"attnscope trace: {trace_name(trace)}"
    d = trace.dims
    sizes = [f"{d.tokens} tokens", f"d_in={d.d_in}", f"d_out={d.d_out}"]
    if d.num_heads:
        sizes.append(f"{d.num_heads} heads of {d.head_dim}")
    sizes += layer_features(trace)
    if d.batch is not None:
        sizes.append(f"batch of {d.batch} (pictures show sequence 0)")
    shown = trace.labels
    if len(shown) > LIST_MAX:  # the first and last few, and how many
        shown = (*shown[: LIST_MAX - 3], "…", *shown[-2:])
    labels = ", ".join(f"<code>{escape(label)}</code>" for label in shown)
    if len(trace.labels) > LIST_MAX:
        labels += f" ({len(trace.labels):,} tokens)"
    module = (
        "" if trace.module is None else f" (<code>{escape(type(trace.module).__name__)}</code>)"
    )
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="meta">kind <code>{escape(trace.kind)}</code>{module} · '
        f"{escape(', '.join(sizes))}</p>",
        f'<p class="meta">tokens: {labels}</p>',
    ]
    if checks is not None:
        body += ["<h2>Checks</h2>", _checks_table(checks)]
    body += ["<h2>Stages</h2>", _stage_table(trace)]
    figures = _figures_available()
    if figures:
        caption = (
            "Every box is a real tensor of this trace: its stage name, the operation that "
            "made it, its shape and (when small) its values."
        )
        fig = pipeline_figure(trace)
        body += ["<h2>Pipeline</h2>", _figure(fig, "the attention pipeline", "pipeline", caption)]
    body += ["<h2>Heatmaps</h2>", _heatmaps(trace, figures)]
    if trace.rows is not None or trace.dims.tokens > LIST_MAX:
        body.append(_summaries(trace, figures))
    if walk is not None:
        body.append(_walk(trace, walk))
    return _finish(_page("\n".join(body), title, full_page), path, overwrite)


# --- check report ---------------------------------------------------------------------------


def _as_matrices(t: torch.Tensor | None) -> list[tuple[str, np.ndarray]]:
    """Split a tensor into 2-D matrices to draw: ``(suffix, (rows, cols))``.

    A vector is one row; ``(H, T, d)`` gives one matrix per head (the first 4); a leading
    batch axis beyond that keeps sequence 0.
    """
    if t is None:
        return []
    a = t.detach().to("cpu", torch.float64).numpy()
    while a.ndim > 3:
        a = a[0]
    if a.ndim <= 2:
        return [("", np.atleast_2d(a))]
    return [(f"head {h}", a[h]) for h in range(min(a.shape[0], 4))]


def _difference(observed: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``observed - reference``; equal infinities (both masked) count as no difference."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = observed - reference
    return np.where(observed == reference, 0.0, diff)


def _failing_check(report: CheckReport) -> StageCheck | None:
    failure = report.first_failure
    for c in report.checks:
        if not c.ok and (failure is None or c.stage == failure.stage):
            return c
    return next((c for c in report.checks if not c.ok), None)


def _side_by_side(check: StageCheck, figures: bool) -> str:
    """Reference, observed and their difference at the failing stage: tables and heatmaps."""
    ref, obs = _as_matrices(check.reference), _as_matrices(check.observed)
    group = "weights" if check.stage is Stage.WEIGHTS else "values"
    columns = [("reference", ref, group), ("your code", obs, group)]
    same_shape = bool(ref) and [m.shape for _, m in ref] == [m.shape for _, m in obs]
    if same_shape:
        diffs = [(s, _difference(o, r)) for (s, r), (_, o) in zip(ref, obs, strict=True)]
        columns.append(("difference (yours − reference)", diffs, "diff"))
    # One colour scale, the reference's, for both: equal numbers get equal colours, and a
    # wrong value (a -1e9 fill, say) shows at the scale's end without flattening the rest.
    basis = [m.ravel() for _, m in (ref or obs)]
    bounds = value_range(np.concatenate(basis), group) if basis else None
    out = ['<div class="side">']
    for name, mats, grp in columns:
        out.append(f'<div class="side-item"><h3>{escape(name)}</h3>')
        if not mats:
            missing = "no reference recorded" if name == "reference" else "not observed"
            out.append(f'<p class="note">{missing}</p></div>')
            continue
        for suffix, m in mats:
            caption = f"{suffix}, " if suffix else ""
            out.append(f'<p class="meta">{escape(caption)}shape {_shape(m.shape)}</p>')
            if max(m.shape) <= TABLE_MAX:
                out.append(_matrix_table(m, group=grp, bounds=None if grp == "diff" else bounds))
            else:
                out.append('<p class="note">too large for a table: see the heatmaps</p>')
        out.append("</div>")
    out.append("</div>")
    if ref and obs and not same_shape:
        out.append('<p class="note">The shapes differ: there is no cell-by-cell difference.</p>')
    if figures and (ref or obs):
        stage = check.stage.value
        panels = [
            Panel(
                name + (f", {s}" if s else ""),
                m,
                group=grp,
                label="difference" if grp == "diff" else stage,
                scale=name != "your code" or not ref,
            )
            for name, mats, grp in columns
            for s, m in mats
        ]
        key = check.stage in MATRIX_STAGES
        fig = matrix_figure(
            panels,
            xlabel="key" if key else "feature",
            ylabel="query" if key else "token",
            title=f"{stage}: " + ", ".join(name for name, mats, _ in columns if mats),
            per_row=3,
        )
        alt = fig.get_suptitle().replace(":", ": heatmaps of", 1)
        out.append(_figure(fig, alt, "heatmap"))
    return "".join(out)


def _check_stage_table(report: CheckReport, failing: StageCheck | None) -> str:
    rows = [
        '<table class="stages"><tr><th>stage</th><th>predicted shape</th>'
        "<th>actual shape</th><th>result</th><th>detail</th><th>location</th></tr>"
    ]
    for c in report.checks:
        cls = ' class="failing"' if c is failing else ""
        location = f"<code>{escape(c.location)}</code>" if c.location else ""
        rows.append(
            f"<tr{cls}><td><code>{c.stage.value}</code></td>"
            f'<td class="num">{_shape(c.predicted)}</td><td class="num">{_shape(c.actual)}</td>'
            f"<td>{_verdict(c.ok)}</td><td>{escape(c.detail)}</td><td>{location}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


@renders(CheckReport, "html")
def check_html(
    report: CheckReport,
    path: str | Path | None = None,
    *,
    overwrite: bool = False,
    full_page: bool | None = None,
) -> str:
    """A self-contained HTML page of a check report.

    The verdict; the first failing stage highlighted with its mistake code, message and
    location, the reference and your tensor side by side with their difference (tables and
    heatmaps); the stages table (predicted and actual shape, pass/fail, detail, location);
    the kind and why it was inferred; notes.

    Args:
        report: a :class:`~attnscope.checking.CheckReport`.
        path: write the page there (refusing to replace a file unless ``overwrite``).
        full_page: a whole ``<!doctype html>`` page (default: when ``path`` is given) or a
            ``<div>`` fragment for notebooks.

    Returns:
        the HTML text.
    """
    from ..checking.mistakes import MISTAKES

    refuse_existing(path, overwrite)
    if full_page is None:
        full_page = path is not None
    title = f"attnscope check: {report.target}"
    failure = report.first_failure
    failing = _failing_check(report)
    body = [f"<h1>{escape(title)}</h1>"]
    if report.ok:
        body.append('<p class="verdict ok">✓ Matches the reference at every stage.</p>')
    else:
        where = f" at <code>{failure.stage.value}</code>" if failure else ""
        body.append(f'<p class="verdict bad">✗ Diverges from the reference{where}.</p>')
    reason = f" — {escape(report.kind_reason)}" if report.kind_reason else ""
    body.append(f'<p class="meta">kind <code>{escape(report.kind)}</code>{reason}</p>')
    if failure is not None:
        mistake = MISTAKES.get(failure.mistake)
        meaning = f" — {escape(mistake.meaning)}" if mistake else ""
        location = failure.location or (failing.location if failing else None)
        body += [
            '<section class="failure" id="first-failure">',
            f"<h2>First failure: <code>{failure.stage.value}</code></h2>",
            f'<p class="meta">mistake <code>{escape(failure.mistake)}</code>{meaning}</p>',
            f'<p class="message">{escape(failure.message)}</p>',
        ]
        if location and location not in failure.message:  # else the message names it
            body.append(f'<p class="meta">look at <code>{escape(location)}</code></p>')
        if failing is not None:
            body.append(_side_by_side(failing, _figures_available()))
        body.append("</section>")
    body += ["<h2>Stages</h2>", _check_stage_table(report, failing)]
    if report.notes:
        notes = "".join(f"<li>{escape(n)}</li>" for n in report.notes)
        body += ["<h2>Notes</h2>", f"<ul>{notes}</ul>"]
    return _finish(_page("\n".join(body), title, full_page), path, overwrite)


def _decode_cell(report: ModelReport, layer: str) -> str:
    """A layer's decoding verdict: pass, the first diverging step (its layer), or not
    reached at that step (a later layer, or a step that raised before any layer)."""
    d = report.decode
    if d.ok:
        return f'<td class="decode" title="{d.steps} cached steps">{_verdict(True)}</td>'
    order = [p for p, _ in report.layers]
    if d.layer == layer:
        return (
            f'<td class="decode"><span class="fail">✗ step {d.step}</span> '
            f"<code>{escape(d.mistake or '')}</code></td>"
        )
    if d.layer is not None and order.index(layer) < order.index(d.layer):
        return f'<td class="decode" title="steps 0..{d.step} agree">{_verdict(True)}</td>'
    before = f"steps 0..{d.step - 1} pass" if d.step else "not reached"
    return f'<td class="decode note" title="step {d.step} diverged before it">{before}</td>'


def _decode_section(d) -> str:
    """Cached decoding: the verdict, the message, and the line to look at."""
    protocol = f" (driven as <code>{escape(d.protocol)}</code>)" if d.protocol else ""
    if d.ok:
        return (
            '<section id="decode"><h2>Decoding with its cache</h2>'
            f"<p>{_verdict(True)} {d.steps} cached steps equal the full pass{protocol}.</p>"
            "</section>"
        )
    where = f" in layer <code>{escape(d.layer)}</code>" if d.layer else ""
    parts = [
        '<section class="failure" id="decode">',
        f"<h2>Decoding with its cache: <code>{escape(d.mistake or '')}</code></h2>",
        f'<p class="meta">first diverging step {d.step}{where}{protocol}</p>',
        f'<p class="message">{escape(d.message)}</p>',
    ]
    if d.location and d.location not in d.message:
        parts.append(f'<p class="meta">look at <code>{escape(d.location)}</code></p>')
    parts.append("</section>")
    return "".join(parts)


@renders(ModelReport, "html")
def model_html(
    report: ModelReport,
    path: str | Path | None = None,
    *,
    overwrite: bool = False,
    full_page: bool | None = None,
) -> str:
    """A model's check as one page: a layers x stages grid (pass, FAIL, or not reached), then
    the first failing layer's own report (its stages, and its tensors side by side)."""
    refuse_existing(path, overwrite)
    if full_page is None:
        full_page = path is not None
    stages = [s for s in Stage if any(c.stage is s for _, r in report.layers for c in r.checks)]
    head = "".join(f"<th><code>{escape(s.value)}</code></th>" for s in stages)
    d = report.decode
    if d is not None:
        head += '<th class="decode">decoding</th>'
    rows = []
    for layer, r in report.layers:
        seen = {c.stage: c.ok for c in r.checks}
        cells = "".join("<td>" + (_verdict(seen[s]) if s in seen else "") + "</td>" for s in stages)
        if d is not None:
            cells += _decode_cell(report, layer)
        css = ' class="failing"' if not r.ok or (d is not None and d.layer == layer) else ""
        rows.append(
            f"<tr{css}><th><code>{escape(layer)}</code></th><td>{escape(r.kind)}</td>{cells}</tr>"
        )
    title = f"attnscope check: {report.target}"
    if report.ok:
        verdict = "OK"
    elif report.first_layer is not None:
        verdict = f"FAILED at {report.first_layer}"
    else:  # every layer right: the decoding failed
        verdict = f"FAILED in decoding ({d.mistake or 'no cache mistake named'} at step {d.step})"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="meta">{_verdict(report.ok)} {escape(verdict)} · '
        f"{len(report.layers)} attention layers, in the order the model runs them</p>",
        f"<table><tr><th>layer</th><th>kind</th>{head}</tr>{''.join(rows)}</table>",
    ]
    if d is not None:
        body.append(_decode_section(d))
    failing = next((r for _, r in report.layers if not r.ok), None)
    if failing is not None:
        body.append(
            f"<h2>First failing layer: <code>{escape(report.first_layer or '')}</code></h2>"
        )
        body.append(check_html(failing, full_page=False))
    return _finish(_page("\n".join(body), title, full_page), path, overwrite)
