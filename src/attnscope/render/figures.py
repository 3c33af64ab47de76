"""Pictures of a trace: heatmaps of the score and weight matrices, and the pipeline diagram.

Everything here draws on a :class:`matplotlib.figure.Figure` with the Agg canvas, never on
pyplot's global state, so figures made in a loop or a server neither leak nor share
settings. matplotlib is imported on first use: ``pip install attnscope[plot]``.

Files are rendered to memory first and written through :func:`attnscope.render.write_output`,
so an existing file is never replaced unless ``overwrite=True``. The format follows the
suffix: ``.png`` or ``.svg``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import functional as AF
from ..display import renders
from ..errors import AttnScopeError, check_token_index, describe
from ..stages import MATRIX_STAGES, Stage
from ..trace import Trace
from .files import claim_output, write_output

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "alibi_slopes_of",
    "heatmap",
    "key_labels",
    "layer_features",
    "pipeline_figure",
    "matrix_figure",
    "stage_panels",
    "trace_name",
    "value_range",
    "window_of",
    "Panel",
    "figure_bytes",
]

# MATRIX_STAGES (from attnscope.stages): the stages a heatmap can show, the (T, T) matrices.
#: Write values in the cells up to this many tokens (beyond, the digits would not fit).
ANNOTATE_MAX = 12
_MATRIX_NAMES = frozenset(s.value for s in MATRIX_STAGES)
#: cells a side that a heatmap draws one per token; a longer input is pooled into tiles
HEATMAP_CELLS = 128
#: Resolution of written PNGs: sharp on high-density screens, still small files.
DPI = 150

_FORMATS = {".png": "png", ".svg": "svg"}
_MASKED_FACE = "#d9d9d9"
_MASKED_EDGE = "#8c8c8c"
_HIGHLIGHT = "#e4572e"
_CMAPS = {"weights": "Blues", "diff": "RdBu_r"}  # anything else: viridis


def _require_matplotlib() -> None:
    """Import matplotlib or say how to install it."""
    try:
        import matplotlib  # noqa: F401
        import matplotlib.figure  # noqa: F401
        from matplotlib.backends import backend_agg  # noqa: F401
    except ImportError as exc:
        raise AttnScopeError(
            "matplotlib: figures need it and it is not installed; "
            "install it with: pip install attnscope[plot]"
        ) from exc


def _new_figure(**kwargs: Any) -> Figure:
    """A Figure on its own Agg canvas: no pyplot, no global figure registry."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    _show_inline_in_notebooks()
    return fig


def _show_inline_in_notebooks() -> None:
    """In a Jupyter kernel, let a returned figure display as a picture.

    IPython learns to draw figures when pyplot's inline backend starts; these figures never
    touch pyplot, so without this a notebook would echo ``<Figure size ...>``. Registered
    once, and only where no formatter for figures exists yet.
    """
    import sys

    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    from matplotlib.figure import Figure

    shell = get_ipython()
    formatters = getattr(getattr(shell, "display_formatter", None), "formatters", {})
    png = formatters.get("image/png")
    if png is None:
        return
    try:
        png.lookup_by_type(Figure)
        return  # pyplot's inline backend (or the user) already draws figures
    except KeyError:
        png.for_type(Figure, lambda fig: figure_bytes(fig, "png"))


def _format_for(path: str | Path) -> str:
    fmt = _FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise AttnScopeError(
            f"path: expected a file name ending in .png or .svg, got {str(path)!r}"
        )
    return fmt


def figure_bytes(fig: Figure, fmt: str = "png", *, dpi: int = DPI) -> bytes:
    """Render ``fig`` to PNG or SVG bytes, reproducibly (no dates, fixed SVG ids)."""
    import matplotlib

    buf = io.BytesIO()
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    with matplotlib.rc_context({"svg.hashsalt": "attnscope"}):
        fig.savefig(buf, format=fmt, dpi=dpi, metadata=metadata)
    return buf.getvalue()


def refuse_existing(path: str | Path | None, overwrite: bool) -> None:
    """Fail before drawing when ``path`` may not be written (see :func:`claim_output`)."""
    if path is not None:
        claim_output(path, overwrite=overwrite)


def _save(fig: Figure, path: str | Path | None, overwrite: bool) -> None:
    if path is not None:
        write_output(path, figure_bytes(fig, _format_for(path)), overwrite=overwrite)


# --- matrices -----------------------------------------------------------------------------


@dataclass
class Panel:
    """One matrix to draw.

    Attributes:
        title: the panel's title.
        values: ``(rows, cols)`` float values (``-inf``/``nan`` allowed where masked).
        mask: ``(rows, cols)`` bool, ``True`` where the cell is masked (drawn hatched grey,
            not coloured); defaults to the non-finite cells.
        group: panels of one group share a colour scale and a colour bar; the group name
            picks the colormap: ``"weights"`` (Blues from 0), ``"diff"`` (diverging around
            0), anything else viridis.
        label: the colour bar's label.
        scale: whether the panel's values set its group's colour range; a panel left out
            (say, a wrong tensor beside the reference) shows its outliers at the ends of
            the reference's range instead of flattening it.
    """

    title: str
    values: np.ndarray
    mask: np.ndarray | None = None
    group: str = "values"
    label: str = ""
    scale: bool = True

    def __post_init__(self) -> None:
        self.values = np.atleast_2d(np.asarray(self.values, dtype=np.float64))
        finite = np.isfinite(self.values)
        self.mask = ~finite if self.mask is None else np.asarray(self.mask, bool) | ~finite


def value_range(values: np.ndarray, group: str) -> tuple[float, float]:
    """The colour range of ``values`` (non-finite ones ignored) for a panel group.

    ``"diff"`` is symmetric around 0, so white means "no difference"; ``"weights"`` start
    at 0, the honest bottom for shares of 1; anything else spans min to max.
    """
    shown = np.asarray(values, dtype=np.float64)
    shown = shown[np.isfinite(shown)]
    if shown.size == 0:
        return 0.0, 1.0
    if group == "diff":
        bound = float(np.abs(shown).max()) or 1.0
        return -bound, bound
    lo = 0.0 if group == "weights" else float(shown.min())
    hi = float(shown.max())
    return lo, hi if hi > lo else lo + 1e-12


def _norm(panels: Sequence[Panel]) -> Any:
    from matplotlib.colors import Normalize

    scaled = [p for p in panels if p.scale] or list(panels)
    shown = np.concatenate([p.values[~p.mask] for p in scaled])
    return Normalize(*value_range(shown, panels[0].group))


def _cell_text(value: float, masked: bool) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "-inf" if value < 0 else "inf"
    if masked:
        return ""
    if abs(value) >= 1e4:  # a fill value like -1e9 in a cell meant for "0.12"
        return f"{value:.0e}"
    text = f"{value:.2f}"
    return "0.00" if text == "-0.00" else text  # a tiny negative is no news


def _text_color(rgba: Sequence[float]) -> str:
    # Relative luminance decides black or white digits, so values stay legible on any cell.
    r, g, b = rgba[:3]
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.5 else "white"


def _short(label: str, limit: int = 14) -> str:
    return label if len(label) <= limit else label[: limit - 1] + "…"


def _set_ticks(axis: Any, labels: Sequence[str], top: bool) -> None:
    n = len(labels)
    step = max(1, math.ceil(n / 40))  # beyond ~40 labels only every step-th is readable
    ticks = list(range(0, n, step))
    texts = [_short(labels[i]) for i in ticks]
    long = max((len(t) for t in texts), default=0) > 3
    if axis.axis_name == "x":
        kw: dict[str, Any] = {"rotation": 45 if long else 0, "rotation_mode": "anchor"}
        kw["ha"] = ("left" if top else "right") if long else "center"
        if long and not top:
            kw["va"] = "top"
    else:
        kw = {}
    # parse_math=False: a label like "$x" is a token, not LaTeX (and cannot break drawing).
    axis.set_ticks(ticks, texts, parse_math=False, **kw)


def _indices(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def _draw_panel(
    ax: Any,
    panel: Panel,
    norm: Any,
    *,
    rows: Sequence[str],
    cols: Sequence[str],
    xlabel: str,
    ylabel: str,
    annotate: bool,
    highlight: tuple[int, int] | None,
) -> Any:
    import matplotlib
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    cmap = matplotlib.colormaps[_CMAPS.get(panel.group, "viridis")].with_extremes(bad=_MASKED_FACE)
    # A masked array: masked cells get the 'bad' colour instead of a colour for their value.
    data = np.ma.masked_array(np.where(panel.mask, 0.0, panel.values), panel.mask)
    image = ax.imshow(data, cmap=cmap, norm=norm, interpolation="nearest", aspect="equal")
    n_rows, n_cols = data.shape
    masked_cells = np.argwhere(panel.mask)
    if len(masked_cells) and max(n_rows, n_cols) <= 64:
        hatch = PatchCollection(
            [Rectangle((c - 0.5, r - 0.5), 1, 1) for r, c in masked_cells],
            facecolor=_MASKED_FACE,
            edgecolor=_MASKED_EDGE,
            hatch="///",
            linewidth=0,
        )
        hatch.set_gid("masked")
        ax.add_collection(hatch)
    if annotate:
        size = 9 if n_cols <= 8 else 7
        for r in range(n_rows):
            for c in range(n_cols):
                value, masked = float(panel.values[r, c]), bool(panel.mask[r, c])
                text = _cell_text(value, masked)
                if text:
                    kw: dict[str, Any] = {"color": _text_color(cmap(norm(value)))}
                    if masked:  # "-inf" on a plain patch, so the hatching does not cross it
                        pad = {"boxstyle": "round,pad=0.15", "fc": _MASKED_FACE, "ec": "none"}
                        kw = {"color": "#333333", "bbox": pad}
                    ax.text(c, r, text, ha="center", va="center", fontsize=size, **kw)
    if highlight is not None:
        r, c = highlight
        box = Rectangle(
            (c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=_HIGHLIGHT, linewidth=2.5, zorder=5
        )
        box.set_gid("highlight")
        ax.add_patch(box)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    _set_ticks(ax.xaxis, cols, top=True)
    _set_ticks(ax.yaxis, rows, top=False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.tick_params(length=0)
    ax.set_title(panel.title, fontsize=10, parse_math=False, pad=4)
    ax.set_xlim(-0.5, n_cols - 0.5)
    ax.set_ylim(n_rows - 0.5, -0.5)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return image


def matrix_figure(
    panels: Sequence[Panel],
    *,
    rows: Sequence[str] | None = None,
    cols: Sequence[str] | None = None,
    xlabel: str = "key",
    ylabel: str = "query",
    title: str = "",
    annotate: bool | None = None,
    highlight: tuple[int, int] | None = None,
    masked_note: str = "masked",
    per_row: int = 4,
) -> Figure:
    """Draw matrices side by side, with a colour bar per group of panels.

    Args:
        panels: the matrices (the same size when ``rows`` or ``cols`` are given).
        rows, cols: tick labels (defaults: the positions ``0..n-1`` of each panel).
        xlabel, ylabel: the axis titles (columns and rows).
        title: the figure's title.
        annotate: write values in the cells (default: when the matrix is at most
            :data:`ANNOTATE_MAX` wide and tall).
        highlight: ``(row, col)`` of one cell to outline on every panel.
        masked_note: the legend entry for masked cells (shown when there are any).
        per_row: panels per row of the figure.
    """
    _require_matplotlib()
    from matplotlib.patches import Patch

    if not panels:
        raise AttnScopeError("panels: expected at least one matrix, got none")
    n_rows = max(p.values.shape[0] for p in panels)
    n_cols = max(p.values.shape[1] for p in panels)
    if annotate is None:
        annotate = max(n_rows, n_cols) <= ANNOTATE_MAX
    # Cells big enough for "-0.12" when annotated; a panel at most ~7 inches (4.5 when
    # several stand side by side), so big matrices stay on a screen.
    budget = 7.0 if len(panels) == 1 else 4.5
    cell = 0.62 if annotate else min(0.3, budget / max(n_rows, n_cols))
    across = min(per_row, len(panels))
    down = math.ceil(len(panels) / across)
    width = across * (n_cols * cell + 1.3) + 1.2
    height = down * (n_rows * cell + 1.4) + (0.6 if title else 0.2)
    fig = _new_figure(figsize=(max(width, 4.0), max(height, 2.6)), layout="constrained")
    fig.get_layout_engine().set(w_pad=0.1, h_pad=0.1)  # inches of margin around it all
    axes = fig.subplots(down, across, squeeze=False).ravel()
    groups: dict[str, list[tuple[Panel, Any]]] = {}
    for panel, ax in zip(panels, axes, strict=False):
        groups.setdefault(panel.group, []).append((panel, ax))
    for members in groups.values():
        norm = _norm([p for p, _ in members])
        image = None
        for panel, ax in members:
            image = _draw_panel(
                ax,
                panel,
                norm,
                rows=_indices(panel.values.shape[0]) if rows is None else rows,
                cols=_indices(panel.values.shape[1]) if cols is None else cols,
                xlabel=xlabel,
                ylabel=ylabel,
                annotate=annotate,
                highlight=highlight,
            )
        label = members[0][0].label
        bar = fig.colorbar(image, ax=[ax for _, ax in members], shrink=0.85, pad=0.02)
        bar.set_label(label, parse_math=False)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=11, parse_math=False)
    if any(p.mask.any() for p in panels):
        swatch = Patch(facecolor=_MASKED_FACE, edgecolor=_MASKED_EDGE, hatch="///")
        fig.legend([swatch], [masked_note], loc="outside lower center", frameon=False, fontsize=9)
    return fig


# --- heatmap of a trace ---------------------------------------------------------------------


def trace_name(trace: Trace) -> str:
    """What was traced, for titles: ``SelfAttentionV1 (self)`` or ``simplified attention``."""
    if trace.module is None:
        return "simplified attention"
    return f"{type(trace.module).__name__} ({trace.kind})"


def query_labels(trace: Trace) -> tuple[str, ...]:
    """The labels of a matrix stage's rows: every token, or a row trace's chosen queries."""
    rows = getattr(trace, "rows", None)
    return trace.labels if rows is None else tuple(trace.labels[r] for r in rows)


def key_labels(trace: Trace) -> tuple[str, ...]:
    """The labels of the keys: the tokens' own, or for cross-attention the positions of the
    sequence attended to (``ctx 0``, ``ctx 1``, ...)."""
    s = trace.dims.key_tokens
    return trace.labels if s is None else tuple(f"ctx {j}" for j in range(s))


def window_of(trace: Trace) -> int | None:
    """The sliding window of the traced layer (keys ``window`` or more back hidden), or None."""
    window = getattr(trace.module, "window", None)
    return window if isinstance(window, int) and "masked_scores" in trace else None


def alibi_slopes_of(trace: Trace) -> list[float] | None:
    """The traced layer's ALiBi slopes, one per head, or None when it adds no ALiBi bias."""
    slopes = getattr(trace.module, "alibi_slopes", None)
    if not getattr(trace.module, "alibi", False) or not isinstance(slopes, torch.Tensor):
        return None
    return [float(v) for v in slopes.flatten().tolist()]


def slope_text(slope: float) -> str:
    """``1/2``, ``1/256`` for ALiBi's powers of two; 3 significant digits otherwise."""
    inverse = 1.0 / slope if slope else 0.0
    if inverse >= 1 and float(inverse).is_integer() and math.log2(inverse).is_integer():
        return f"1/{int(inverse)}"
    return f"{slope:.3g}"


def layer_features(trace: Trace) -> list[str]:
    """What a modern layer adds to the book's pipeline, in words: grouped key/value heads,
    QK norm, rotary embeddings, ALiBi, a sliding window, cross-attention (empty for the
    book's layers)."""
    module, d = trace.module, trace.dims
    out = []
    if d.kv_heads is not None and d.num_heads:
        out.append(f"{d.kv_heads} kv heads, each shared by {d.num_heads // d.kv_heads} query heads")
    norm = getattr(module, "qk_norm", None)
    if isinstance(norm, str):
        out.append(f"QK norm ({norm})")
    if "rotated_queries" in trace:
        pairing = getattr(module, "rope_pairing", "half")
        freqs = getattr(module, "inv_freq", None)
        rot = 2 * freqs.shape[0] if isinstance(freqs, torch.Tensor) else d.head_dim
        part = "" if rot == d.head_dim else f", {rot} of {d.head_dim} features"
        out.append(f"RoPE ({pairing} pairing{part})")
    slopes = alibi_slopes_of(trace)
    if slopes is not None:
        out.append(f"ALiBi (slopes {slope_text(slopes[0])} .. {slope_text(slopes[-1])})")
    window = window_of(trace)
    if window is not None:
        out.append(f"sliding window of {window} keys")
    if d.key_tokens is not None:
        out.append(f"cross-attention to {d.key_tokens} tokens")
    return out


def _batch_index(trace: Trace, batch: object) -> int | None:
    """``batch`` checked against the trace: the sequence to draw, or None when unbatched."""
    if trace.dims.batch is None:
        if batch != 0:
            raise AttnScopeError(f"batch: expected 0 for an unbatched trace, got {describe(batch)}")
        return None
    return check_token_index(batch, trace.dims.batch, name="batch", noun="sequences")


def _select(tensor: torch.Tensor, batch: int | None) -> torch.Tensor:
    """Drop the batch axis (keep sequence ``batch``; ``None``: unbatched), as float64."""
    if batch is not None:
        tensor = tensor[batch]
    return tensor.detach().to("cpu", torch.float64)


def _matrix_stage(trace: Trace, stage: str | Stage) -> Stage:
    names = ", ".join(s.value for s in MATRIX_STAGES)
    try:
        st = Stage(stage)
    except ValueError:
        raise AttnScopeError(f"stage: expected one of {names}, got {stage!r}") from None
    if st not in MATRIX_STAGES:
        raise AttnScopeError(
            f"stage: expected one of {names} (a tokens x tokens matrix), got {st.value!r}"
        )
    if st.value not in trace:
        have = ", ".join(s.value for s in MATRIX_STAGES if s.value in trace)
        raise AttnScopeError(
            f"stage: expected one of {have} for a {trace.kind} trace, got {st.value!r}"
        )
    return st


def _check_highlight(
    highlight: object, tokens: int, keys: int | None = None
) -> tuple[int, int] | None:
    if highlight is None:
        return None
    if not isinstance(highlight, Sequence) or isinstance(highlight, str) or len(highlight) != 2:
        raise AttnScopeError(
            f"highlight: expected a (query, key) pair of positions, got {describe(highlight)}"
        )
    q = check_token_index(highlight[0], tokens, name="highlight query")
    k = check_token_index(highlight[1], tokens if keys is None else keys, name="highlight key")
    return q, k


def stage_panels(trace: Trace, stage: str | Stage, batch: int = 0) -> list[Panel]:
    """The ``(T, T)`` matrices of one stage, one :class:`Panel` per head, masks marked.

    Needs no matplotlib: the HTML report draws these as tables when it is missing.
    """
    return panels_of(trace, _matrix_stage(trace, stage), _batch_index(trace, batch))


def pool_of(trace: Trace) -> int:
    """Tokens per cell side of a trace's heatmap: 1 up to :data:`HEATMAP_CELLS` tokens (or
    keys); beyond, enough to bring the picture down to that many cells a side."""
    tokens = max(trace.dims.tokens, trace.dims.key_tokens or 0)
    return 1 if tokens <= HEATMAP_CELLS else math.ceil(tokens / HEATMAP_CELLS)


def pooled_panels(trace: Trace, st: Stage, batch: int | None, pool: int, reduce: str):
    """The panels of a stage pooled over ``pool x pool`` tiles (:meth:`Trace.pooled`):
    ``(panels, pooled)``; tiles no query may see are the masked cells."""
    pooled = trace.pooled(st, pool=pool, reduce=reduce)
    values = _select(pooled.values, batch)
    mask = pooled.hidden.expand(values.shape) | ~torch.isfinite(values)
    return _panels(trace, st, values, mask), pooled


def panels_of(trace: Trace, st: Stage, batch: int | None) -> list[Panel]:
    """:func:`stage_panels` for a stage of the trace and a batch index already checked."""
    values = _select(trace[st], batch)  # (T, T) or (H, T, T)
    mask = ~torch.isfinite(values)
    if st is Stage.WEIGHTS and Stage.MASKED_SCORES.value in trace:
        # A weight of 0 at a masked key is the mask at work, not a small weight.
        mask |= torch.isneginf(_select(trace[Stage.MASKED_SCORES], batch))
    return _panels(trace, st, values, mask)


def _panels(trace: Trace, st: Stage, values: torch.Tensor, mask: torch.Tensor) -> list[Panel]:
    heads = trace.dims.num_heads
    values = values.reshape(-1, *values.shape[-2:])  # (H or 1, T, T)
    mask = mask.reshape(values.shape)
    group = "weights" if st is Stage.WEIGHTS else "scores"
    titles = ["" if heads is None else f"head {h}" for h in range(values.shape[0])]
    kv = trace.dims.kv_heads
    if kv is not None and heads is not None:  # grouped: say which kv head each one reads
        titles = [f"{t} (kv head {h // (heads // kv)})" for h, t in enumerate(titles)]
    slopes = alibi_slopes_of(trace)
    if slopes is not None and st.order >= Stage.BIASED_SCORES.order and heads is not None:
        titles = [f"{t}, ALiBi slope {slope_text(s)}" for t, s in zip(titles, slopes, strict=True)]
    return [
        Panel(
            titles[h],
            values[h].numpy(),
            mask[h].numpy(),
            group=group,
            label=st.value,
        )
        for h in range(values.shape[0])
    ]


@renders(Trace, "heatmap")
def heatmap(
    trace: Trace,
    stage: str | Stage = "weights",
    path: str | Path | None = None,
    *,
    highlight: tuple[int, int] | None = None,
    batch: int = 0,
    annotate: bool | None = None,
    reduce: str = "max",
    overwrite: bool = False,
) -> Figure:
    """Heatmap of one ``(T, T)`` stage: rows are queries, columns are keys.

    Args:
        trace: a :class:`~attnscope.Trace`.
        stage: ``scores``, ``scaled_scores``, ``biased_scores``, ``masked_scores`` or
            ``weights``.
        path: write the picture there; ``.png`` or ``.svg``.
        highlight: ``(query, key)`` cell to outline, e.g. ``(1, 1)``: the second query
            against key 1.
        batch: which sequence of a batched trace.
        annotate: write values (2 decimals) in the cells; default when ``T <= 12``.
        reduce: for an input longer than :data:`HEATMAP_CELLS` tokens, each cell is a tile
            of (query, key) pairs, drawn as their ``"max"`` or ``"mean"``.
        overwrite: replace an existing ``path``.

    Above :data:`HEATMAP_CELLS` tokens (or keys) a cell per token is more than a screen
    shows: the matrix is pooled into tiles (the title says how), block by block, so a row
    trace of a long input draws every query without ever holding the matrix.

    Masked cells (``-inf`` scores, and the zero weights they give in a causal trace) are
    drawn hatched grey, not as colours: the future, and the keys outside a sliding window
    (the legend says so when the layer has one). Multi-head traces get one panel per head,
    on a shared colour scale; an ALiBi layer's panels name each head's slope from
    ``biased_scores`` on, and the title says what the bias is.

    Returns:
        the :class:`matplotlib.figure.Figure`.
    """
    _require_matplotlib()
    st = _matrix_stage(trace, stage)
    if path is not None:  # refuse a bad name before drawing anything
        _format_for(path)
        refuse_existing(path, overwrite)
    if reduce not in AF.REDUCTIONS:
        raise AttnScopeError(f"reduce: expected 'max' or 'mean', got {describe(reduce)}")
    cell = _check_highlight(highlight, trace.dims.tokens, len(key_labels(trace)))
    pooled = pool_of(trace) > 1  # pooled pictures show every query
    if cell is not None and trace.rows is not None and not pooled:  # the chosen rows only
        if cell[0] not in trace.rows:
            raise AttnScopeError(
                f"highlight: expected a query among the traced rows {list(trace.rows)}, "
                f"got {cell[0]}"
            )
        cell = (trace.rows.index(cell[0]), cell[1])
    fig = draw_heatmap(trace, st, cell, _batch_index(trace, batch), annotate, reduce)
    _save(fig, path, overwrite)
    return fig


def draw_heatmap(
    trace: Trace,
    st: Stage,
    cell: tuple[int, int] | None = None,
    batch: int | None = None,
    annotate: bool | None = None,
    reduce: str = "max",
) -> Figure:
    """:func:`heatmap`'s drawing, from values already checked: a stage the trace has, an
    in-range ``(query, key)`` cell or None, and the batch index (None when unbatched)."""
    pool = pool_of(trace)
    if pool > 1:
        return _draw_pooled(trace, st, cell, batch, pool, reduce)
    title = f"{st.value} — {trace_name(trace)}"
    if batch is not None:
        title += f", sequence {batch}"
    if cell is not None:
        q, k = cell
        title += (
            f"\nhighlighted: query “{query_labels(trace)[q]}” (row {q}), "
            f"key “{key_labels(trace)[k]}” (column {k})"
        )
    slopes = alibi_slopes_of(trace)
    if slopes is not None and st.order >= Stage.BIASED_SCORES.order:
        title += "\nALiBi bias added to the scaled scores: −slope × |query − key| per head"
    masked_note = masked_note_of(trace, st)
    return matrix_figure(
        panels_of(trace, st, batch),
        rows=query_labels(trace),
        cols=key_labels(trace),
        title=title,
        annotate=annotate,
        highlight=cell,
        masked_note=masked_note,
    )


def _draw_pooled(
    trace: Trace,
    st: Stage,
    cell: tuple[int, int] | None,
    batch: int | None,
    pool: int,
    reduce: str,
) -> Figure:
    """A heatmap too large to read, drawn one cell per ``pool x pool`` tile of (query, key)
    pairs, computed block by block (a row trace never builds the matrix for it)."""
    panels, pooled = pooled_panels(trace, st, batch, pool, reduce)
    n_rows, n_cols = pooled.values.shape[-2:]
    title = f"{st.value} — {trace_name(trace)}"
    if batch is not None:
        title += f", sequence {batch}"
    title += (
        f"\n{pooled.describe()}: {pooled.tokens:,} queries x {pooled.keys:,} keys in "
        f"{n_rows} x {n_cols} cells"
    )
    if cell is not None:
        q, k = cell
        title += f"\nhighlighted: the tile holding query {q} and key {k}"
        cell = (q // pool, k // pool)
    slopes = alibi_slopes_of(trace)
    if slopes is not None and st.order >= Stage.BIASED_SCORES.order:
        title += "\nALiBi bias added to the scaled scores: −slope × |query − key| per head"
    for p in panels:
        p.label = f"{st.value} ({reduce} per tile)"
    return matrix_figure(
        panels,
        rows=_tile_labels(pooled.tokens, pool),
        cols=_tile_labels(pooled.keys, pool),
        xlabel=f"keys, {pool} per cell",
        ylabel=f"queries, {pool} per cell",
        title=title,
        annotate=False,
        highlight=cell,
        masked_note="hidden tile: no query in it may see any of its keys",
    )


def _tile_labels(n: int, pool: int) -> list[str]:
    """Each tile by the first position it holds (``0``, ``40``, ``80``, ...), about ten of
    them named along an axis."""
    starts = range(0, n, pool)
    step = max(1, math.ceil(len(starts) / 40))  # the ticks _set_ticks keeps
    every = step * max(1, math.ceil(len(starts) / (10 * step)))
    return [f"{p:,}" if i % every == 0 else "" for i, p in enumerate(starts)]


#: at most this many points per line in a summary figure; longer inputs are averaged in bins
SUMMARY_POINTS = 500


def summary_figure(trace: Trace, batch: int = 0) -> Figure:
    """Every query's summary over positions, one line per head: the entropy of its weights
    and the weight on the first token (attention sinks). Long inputs are averaged over bins
    of positions (the axis says how many per point)."""
    _require_matplotlib()
    b = _batch_index(trace, batch)
    s = trace.summary if b is None else trace.summary.select(b)
    heads = trace.dims.num_heads
    pos = s.positions.to(torch.float64)
    n = pos.numel()
    per = max(1, math.ceil(n / SUMMARY_POINTS))
    fig = _new_figure(figsize=(10.0, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, name, label in (
        (axes[0], "entropy", "entropy of the weights (nats)"),
        (axes[1], "sink_weight", "weight on the first token"),
    ):
        values = getattr(s, name).to(torch.float64).reshape(heads or 1, n)
        x = pos
        if per > 1:  # mean over bins of `per` positions (the last bin may be shorter)
            pad = -n % per
            v = torch.nn.functional.pad(values, (0, pad), value=float("nan"))
            values = v.reshape(values.shape[0], -1, per).nanmean(-1)
            x = torch.nn.functional.pad(pos, (0, pad), value=float("nan"))
            x = x.reshape(-1, per).nanmean(-1)
        for h in range(values.shape[0]):
            ax.plot(x.numpy(), values[h].numpy(), linewidth=1.0, label=f"head {h}")
        ax.set_xlabel("query position" + (f" (mean of {per} per point)" if per > 1 else ""))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if heads and heads <= 16:
        axes[1].legend(fontsize=7, ncol=2, frameon=False)
    title = f"every query's summary — {trace_name(trace)}, {n:,} queries"
    if b is not None:
        title += f", sequence {b}"
    fig.suptitle(title, fontsize=11, parse_math=False)
    return fig


def masked_note_of(trace: Trace, st: Stage) -> str:
    """The legend of a heatmap's hatched cells: the future, and the window when there is one."""
    window = window_of(trace)
    if st is Stage.WEIGHTS:
        hidden = "masked: key after the query"
    else:
        hidden = "masked (-inf): key after the query"
    if window is None:
        return hidden if st is Stage.WEIGHTS else "masked (-inf)"
    return f"{hidden} or outside the window (keys {window} or more back)"


# --- the pipeline diagram -------------------------------------------------------------------

_TITLE_PT, _SUB_PT, _SHAPE_PT, _VALUE_PT = 10.0, 8.0, 8.0, 7.5
_PAD, _GAP_X, _GAP_Y, _LINE_GAP = 0.1, 0.42, 0.3, 0.05  # inches
_VALUES_MAX = 8  # show values when a box's matrix is at most 8 x 8
_FILL = {
    "input": "#eeeeee",
    "param": "#f6f1e7",
    "proj": "#e3eefa",
    "scores": "#fdf0dc",
    "context": "#e2f3e8",
}


@dataclass
class _Box:
    key: str
    title: str
    subtitle: str
    shape: tuple[int, ...]
    values: torch.Tensor | None  # a 1-D or 2-D slice to print, or None
    fill: str
    col: int
    row: int
    note: str = ""
    x: float = 0.0  # left, inches
    y: float = 0.0  # top, inches
    w: float = 0.0
    h: float = 0.0
    texts: tuple = ()

    @property
    def cx(self) -> float:
        return self.x + self.w / 2

    @property
    def cy(self) -> float:
        return self.y - self.h / 2

    def left(self) -> tuple[float, float]:
        return self.x, self.cy

    def right(self) -> tuple[float, float]:
        return self.x + self.w, self.cy

    def top(self) -> tuple[float, float]:
        return self.cx, self.y

    def bottom(self) -> tuple[float, float]:
        return self.cx, self.y - self.h


def _value_lines(values: torch.Tensor | None) -> list[str]:
    """Right-aligned 2-decimal rows of a small matrix (a vector is one row)."""
    if values is None:
        return []
    matrix = values.reshape(1, -1) if values.dim() == 1 else values
    if matrix.dim() != 2 or max(matrix.shape) > _VALUES_MAX:
        return []
    cells = [[_cell_text(float(v), False) for v in row] for row in matrix.tolist()]
    width = max(len(c) for row in cells for c in row)
    return [" ".join(c.rjust(width) for c in row) for row in cells]


def _weight_box(module: Any, name: str, row: int) -> _Box:
    w = getattr(module, name)
    if isinstance(w, torch.nn.Parameter):
        sub, tensor = "x @ W (d_in, d_out)", w
    else:  # nn.Linear keeps its weight (d_out, d_in) and computes x @ weight.T (+ bias)
        sub = "Linear: x @ weight.T" + (" + bias" if w.bias is not None else "")
        tensor = w.weight
    tensor = tensor.detach().to("cpu", torch.float64)
    return _Box(name, name, sub, tuple(tensor.shape), tensor, "param", 1, row)


def _pipeline_boxes(trace: Trace, batch: int | None) -> list[_Box]:
    heads, kv = trace.dims.num_heads, trace.dims.kv_heads

    def values(name: str) -> torch.Tensor:
        v = _select(trace[name], batch)
        return v[0] if heads is not None and name != "output" else v

    def box(name: str, title: str, sub: str, fill: str, col: int, row: int) -> _Box:
        shown = values(name)
        note = ""
        if heads is not None and name != "output":
            shared = kv is not None and name.endswith(("keys", "values"))
            note = f"kv head 0 of {kv}" if shared else f"head 0 of {heads}"
        if trace.rows is not None and name in _MATRIX_NAMES:  # a row trace keeps a few rows
            listed = ", ".join(str(r) for r in trace.rows[:3]) + (
                ", ..." if len(trace.rows) > 3 else ""
            )
            sub = f"{sub}; rows {listed} only"
        return _Box(name, title, sub, tuple(trace[name].shape), shown, fill, col, row, note)

    x = _select(trace.inputs, batch)
    if trace.module is None:  # simplified: the inputs are the queries, keys and values
        return [
            _Box(
                "inputs",
                "inputs X",
                "queries = keys = values",
                tuple(trace.inputs.shape),
                x,
                "input",
                0,
                0,
            ),
            box("scores", "scores", "X @ X.T", "scores", 1, 0),
            box("weights", "weights", "softmax over keys", "scores", 2, 0),
            box("context", "context Z", "weights @ X", "context", 2, 1),
        ]
    split = f", split into {heads} heads" if heads else ""
    kv_split = split if kv is None else f", split into {kv} kv head{'s' if kv > 1 else ''}"
    d_k = trace["keys"].shape[-1]
    boxes = [
        _Box("inputs", "inputs X", "one row per token", tuple(trace.inputs.shape), x, "input", 0, 1)
    ]
    for row, (w, name) in enumerate(
        [("W_query", "queries"), ("W_key", "keys"), ("W_value", "values")]
    ):
        boxes.append(_weight_box(trace.module, w, row))
        source = "context" if row and trace.dims.key_tokens is not None else "x"  # cross
        sub = f"{source} @ {w}{split if row == 0 else kv_split}"
        boxes.append(box(name, name, sub, "proj", 2, row))
    col = 2  # the last column of queries and keys
    for step, sub in _qk_steps(trace):
        col += 1
        for row, name in enumerate((f"{step}_queries", f"{step}_keys")):
            boxes.append(box(name, name, sub, "proj", col, row))
    scores_sub = "queries @ keys.T"
    if kv is not None and heads:
        scores_sub += f", head h with kv head h // {heads // kv}"
    boxes += [
        box("scores", "scores", scores_sub, "scores", col + 1, 0),
        box(
            "scaled_scores",
            "scaled_scores",
            f"scores / √d_k = scores / {d_k**0.5:.3g}",
            "scores",
            col + 2,
            0,
        ),
    ]
    chain_col = col + 2
    if "biased_scores" in trace:
        chain_col += 1
        bias = "+ ALiBi: −slope × |query − key|" if alibi_slopes_of(trace) else "+ position bias"
        boxes.append(box("biased_scores", "biased_scores", bias, "scores", chain_col, 0))
    if "masked_scores" in trace:
        chain_col += 1
        window = window_of(trace)
        hidden = "keys after the query: -inf"
        if window is not None:
            hidden = f"after the query or {window}+ back: -inf"
        boxes.append(box("masked_scores", "masked_scores", hidden, "scores", chain_col, 0))
    boxes += [
        box("weights", "weights", "softmax over keys (dim=-1)", "scores", col + 2, 2),
        box("context", "context Z", "weights @ values", "context", col + 1, 2),
    ]
    if "output" in trace:
        boxes.append(box("output", "output", "heads merged, out_proj", "context", col + 1, 3))
    return boxes


def _qk_steps(trace: Trace) -> list[tuple[str, str]]:
    """What a modern layer does to queries and keys between the projection and the scores:
    ``(stage prefix, subtitle)`` for the norm and the rotation it has, in order."""
    steps = []
    if "normed_queries" in trace:
        where = getattr(trace.module, "qk_norm", None)
        over = "over the whole projection" if where == "full" else "per head"
        steps.append(("normed", f"RMSNorm {over} (q_norm, k_norm)"))
    if "rotated_queries" in trace:
        pairing = getattr(trace.module, "rope_pairing", "half")
        freqs = getattr(trace.module, "inv_freq", None)
        d = trace.dims.head_dim
        rot = 2 * freqs.shape[0] if isinstance(freqs, torch.Tensor) else d
        part = "" if rot == d else f", first {rot} of {d}"
        steps.append(("rotated", f"RoPE: pairs turned by position ({pairing}{part})"))
    return steps


def _measure(fig: Figure, texts: Sequence[Any]) -> list[tuple[float, float]]:
    """Width and height of each text in inches, the largest over the usual resolutions.

    Hinted glyphs make text up to ~15% wider at some resolutions than at others; boxes
    sized at the widest fit their text in the PNG (150 dpi), SVG (72) and notebook (100).
    """
    sizes = [(0.0, 0.0)] * len(texts)
    dpi = fig.dpi
    for trial in (72, 100, DPI):
        fig.set_dpi(trial)
        renderer = fig.canvas.get_renderer()
        for i, t in enumerate(texts):
            extent = t.get_window_extent(renderer)
            w, h = sizes[i]
            sizes[i] = (max(w, extent.width / trial), max(h, extent.height / trial))
    fig.set_dpi(dpi)
    return sizes


def _layout(fig: Figure, ax: Any, boxes: list[_Box]) -> tuple[float, float]:
    """Size every box from its text, then place boxes on their (col, row) grid; inches."""
    mono = {"family": "monospace", "parse_math": False, "va": "top"}
    plain = {"parse_math": False, "va": "top"}
    for b in boxes:
        block = "\n".join(_value_lines(b.values))
        shape = f"shape {b.shape}" + (f"  ({b.note})" if b.note and block else "")
        lines = [
            ax.text(0, 0, b.title, fontsize=_TITLE_PT, weight="bold", **plain),
            ax.text(0, 0, b.subtitle, fontsize=_SUB_PT, style="italic", color="#444", **plain),
            ax.text(0, 0, shape, fontsize=_SHAPE_PT, color="#222", **mono),
        ]
        if block:
            lines.append(ax.text(0, 0, block, fontsize=_VALUE_PT, linespacing=1.25, **mono))
        b.texts = tuple(lines)
    measured = iter(_measure(fig, [t for b in boxes for t in b.texts]))
    sizes = {b.key: [next(measured) for _ in b.texts] for b in boxes}
    for b in boxes:
        b.w = max(w for w, _ in sizes[b.key]) + 2 * _PAD
        b.h = sum(h for _, h in sizes[b.key]) + _LINE_GAP * (len(b.texts) - 1) + 2 * _PAD
    n_cols = max(b.col for b in boxes) + 1
    n_rows = max(b.row for b in boxes) + 1
    col_w = [max((b.w for b in boxes if b.col == c), default=0.0) for c in range(n_cols)]
    row_h = [max((b.h for b in boxes if b.row == r), default=0.0) for r in range(n_rows)]
    # An empty row (the keys' row right of the projections) keeps a little room for arrows.
    row_h = [h or 0.3 for h in row_h]
    width = sum(col_w) + _GAP_X * (n_cols - 1)
    height = sum(row_h) + _GAP_Y * (n_rows - 1)
    for b in boxes:
        left = sum(col_w[: b.col]) + _GAP_X * b.col
        top = height - sum(row_h[: b.row]) - _GAP_Y * b.row
        b.x = left + (col_w[b.col] - b.w) / 2
        b.y = top - (row_h[b.row] - b.h) / 2
        y = b.y - _PAD
        for t, (_, h) in zip(b.texts, sizes[b.key], strict=True):
            t.set_position((b.x + _PAD, y))
            y -= h + _LINE_GAP
    return width, height


def _arrow(ax: Any, *points: tuple[float, float]) -> None:
    """An orthogonal connector through ``points``, with its head at the last one."""
    color = "#555555"
    if len(points) > 2:
        xs, ys = zip(*points[:-1], strict=True)
        ax.plot(xs, ys, color=color, linewidth=1.2, solid_capstyle="butt")
    ax.annotate(
        "",
        xy=points[-1],
        xytext=points[-2],
        arrowprops={
            "arrowstyle": "-|>",
            "color": color,
            "linewidth": 1.2,
            "shrinkA": 0,
            "shrinkB": 0,
            "mutation_scale": 12,
        },
    )


def _connect(ax: Any, boxes: dict[str, _Box]) -> None:
    def across(a: _Box, b: _Box) -> None:  # a to b in the same row, either direction
        if a.x < b.x:
            _arrow(ax, a.right(), b.left())
        else:
            _arrow(ax, a.left(), b.right())

    inputs = boxes["inputs"]
    if "W_query" not in boxes:  # simplified
        across(inputs, boxes["scores"])
        across(boxes["scores"], boxes["weights"])
        w, z = boxes["weights"], boxes["context"]
        _arrow(ax, w.bottom(), z.top())
        _arrow(ax, inputs.bottom(), (inputs.cx, z.cy), z.left())
        return
    elbow = inputs.x + inputs.w + _GAP_X / 2
    for w_name, name in [("W_query", "queries"), ("W_key", "keys"), ("W_value", "values")]:
        w = boxes[w_name]
        _arrow(ax, inputs.right(), (elbow, inputs.cy), (elbow, w.cy), w.left())
        across(w, boxes[name])
    scores = boxes["scores"]
    for side in ("queries", "keys"):  # through the norm and the rotation, when there
        path = [boxes[k] for k in (side, f"normed_{side}", f"rotated_{side}") if k in boxes]
        for a, b in zip(path, path[1:], strict=False):
            across(a, b)
        if side == "queries":
            across(path[-1], scores)
        else:
            _arrow(ax, path[-1].right(), (scores.cx, path[-1].cy), scores.bottom())
    chain = [boxes[k] for k in ("scaled_scores", "biased_scores", "masked_scores") if k in boxes]
    across(scores, chain[0])
    for a, b in zip(chain, chain[1:], strict=False):
        across(a, b)
    last, weights, context = chain[-1], boxes["weights"], boxes["context"]
    if last.col == weights.col:
        _arrow(ax, last.bottom(), weights.top())
    else:  # the U-turn from masked_scores back to weights
        _arrow(ax, last.bottom(), (last.cx, weights.cy), weights.right())
    across(weights, context)
    across(boxes["values"], context)
    if "output" in boxes:
        _arrow(ax, context.bottom(), boxes["output"].top())


@renders(Trace, "pipeline")
def pipeline_figure(
    trace: Trace,
    path: str | Path | None = None,
    *,
    batch: int = 0,
    overwrite: bool = False,
) -> Figure:
    """The seed's pipeline diagram, drawn from a real trace.

    ``X -> W_query/W_key/W_value -> queries, keys, values -> [normed_queries, normed_keys]
    -> [rotated_queries, rotated_keys] -> scores -> scaled_scores -> [biased_scores] ->
    [masked_scores] -> weights -> context (Z) -> [output]``: every box carries its stage
    name, the operation that made it, its real shape and, when at most 8 x 8, its real
    values (sequence ``batch``; head 0 of multi-head stages, kv head 0 of grouped keys and
    values). Simplified attention has no projections: the inputs serve as queries, keys
    and values.

    Args:
        trace: a :class:`~attnscope.Trace`.
        path: write the picture there; ``.png`` or ``.svg``.
        batch: which sequence of a batched trace to show values of.
        overwrite: replace an existing ``path``.

    Returns:
        the :class:`matplotlib.figure.Figure`, sized to fit its boxes.
    """
    _require_matplotlib()
    from matplotlib.patches import FancyBboxPatch

    if path is not None:
        _format_for(path)
        refuse_existing(path, overwrite)
    batch = _batch_index(trace, batch)
    boxes = _pipeline_boxes(trace, batch)
    fig = _new_figure(figsize=(8, 4))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    width, height = _layout(fig, ax, boxes)
    margin, head = 0.15, 0.45
    fig.set_size_inches(width + 2 * margin, height + 2 * margin + head)
    ax.set_xlim(-margin, width + margin)
    ax.set_ylim(-margin, height + margin + head)
    for b in boxes:
        ax.add_patch(
            FancyBboxPatch(
                (b.x, b.y - b.h),
                b.w,
                b.h,
                boxstyle="round,pad=0,rounding_size=0.06",
                facecolor=_FILL[b.fill],
                edgecolor="#666666",
                linewidth=1.0,
                gid=f"box-{b.key}",
            )
        )
    _connect(ax, {b.key: b for b in boxes})
    d = trace.dims
    sizes = f"{d.tokens:,} tokens, d_in={d.d_in}, d_out={d.d_out}"
    if d.num_heads:
        sizes += f", {d.num_heads} heads of {d.head_dim}"
    features = layer_features(trace)
    if features:
        sizes += "; " + ", ".join(features)
    if d.batch is not None:
        sizes += f"; values of sequence {batch} of {d.batch}"
    ax.text(
        0,
        height + margin + head / 2,
        f"{trace_name(trace)}: {sizes}",
        fontsize=11,
        weight="bold",
        va="center",
        parse_math=False,
    )
    _save(fig, path, overwrite)
    return fig
