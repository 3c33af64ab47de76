"""One door from data to its renderers.

Traces, single-query walks and check reports are data; :mod:`attnscope.render` draws them.
Data never imports its renderers: each renderer registers itself here for the type it draws
(``@renders(Trace, "html")``), and the methods users expect on the data (``t.plot``,
``t.to_html``, ``report.to_html``, ``_repr_html_``, ``str``) come from :class:`Rendered`,
which looks the renderer up. ``import attnscope`` imports the renderers, so the table is
full before any of these methods can run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["Rendered", "render", "renders"]

_RENDERERS: dict[tuple[type, str], Callable[..., Any]] = {}


def renders(cls: type, form: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the ``form`` renderer of ``cls`` (and subclasses)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _RENDERERS[(cls, form)] = fn
        return fn

    return register


def render(obj: object, form: str, *args: Any, **kwargs: Any) -> Any:
    """Draw ``obj`` as ``form`` (``"text"``, ``"html"``, ``"heatmap"``, ``"pipeline"``)."""
    for cls in type(obj).__mro__:
        fn = _RENDERERS.get((cls, form))
        if fn is not None:
            return fn(obj, *args, **kwargs)
    raise LookupError(f"no {form} renderer for {type(obj).__name__}: is attnscope.render imported?")


def _closed(fig: Any, path: str | Path) -> Path:
    """A figure written to ``path`` is done with: close it (a REPL then echoes the path)."""
    import matplotlib.pyplot as plt

    plt.close(fig)
    return Path(path)


class Rendered:
    """Text, HTML and (for traces) figures of a data object, through its registered renderers.

    With a ``path``, each method writes the file (never over an existing one unless
    ``overwrite=True``) and returns the path, so a notebook or REPL echoes a short path, not
    the whole page.
    """

    #: what ``_repr_html_`` shows in a notebook: a fragment, never a whole page
    _html_fragment: ClassVar[bool] = True

    def to_text(self, color: bool | None = None) -> str:
        """Plain or coloured text (colour by default on a terminal without ``NO_COLOR``)."""
        return render(self, "text", color=color)

    def to_html(self, path: str | Path | None = None, *, overwrite: bool = False) -> str | Path:
        """A self-contained HTML report: the HTML, or with ``path`` the path written."""
        html = render(self, "html", path=path, overwrite=overwrite)
        return html if path is None else Path(path)

    def _repr_html_(self) -> str:
        return render(self, "html")

    def __str__(self) -> str:
        return self.to_text(color=False)  # str() is plain text wherever it is printed


class RenderedFigures(Rendered):
    """:class:`Rendered`, plus the heatmap and pipeline figure of a trace."""

    def plot(self, stage: str = "weights", path: str | Path | None = None, **kwargs: Any):
        """Heatmap of ``stage`` (scores, scaled_scores, masked_scores or weights): the
        matplotlib figure, or with ``path`` the path written (``overwrite=True`` to replace
        a file)."""
        fig = render(self, "heatmap", stage=stage, path=path, **kwargs)
        return fig if path is None else _closed(fig, path)

    def pipeline_figure(self, path: str | Path | None = None, **kwargs: Any):
        """The seed's pipeline diagram, drawn from this trace's real shapes and values: the
        figure, or with ``path`` the path written."""
        fig = render(self, "pipeline", path=path, **kwargs)
        return fig if path is None else _closed(fig, path)
