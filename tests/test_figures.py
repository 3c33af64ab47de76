"""Heatmaps and the pipeline figure: written files, masked cells, highlight, heads, errors."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

import attnscope as a
from attnscope import AttnScopeError
from attnscope.render.figures import heatmap, pipeline_figure

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402
from matplotlib.collections import PatchCollection  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def book_trace():
    """The book's V1 on its six embeddings, seed 123: the seed's running example."""
    torch.manual_seed(123)
    return a.trace(a.SelfAttentionV1(3, 2), a.book_embeddings(), labels=a.BOOK_TOKENS)


@pytest.fixture(scope="module")
def causal_trace():
    torch.manual_seed(0)
    return a.CausalAttention(3, 2, 6, 0.0).trace(a.book_embeddings(), labels=a.BOOK_TOKENS)


@pytest.fixture(scope="module")
def multihead_trace():
    torch.manual_seed(0)
    x = torch.stack([a.book_embeddings(), a.book_embeddings().flip(0)])
    return a.MultiHeadAttention(3, 6, 6, 0.0, num_heads=3).trace(x)


def _image_axes(fig):
    return [
        ax for ax in fig.axes if ax.images and ax.get_visible() and ax.get_label() != "<colorbar>"
    ]


def _by_gid(ax, gid, kind):
    found = [p for p in ax.patches if p.get_gid() == gid and isinstance(p, kind)]
    found += [c for c in ax.collections if c.get_gid() == gid and isinstance(c, kind)]
    return found


def test_heatmap_png_is_written_and_not_blank(book_trace, tmp_path):
    path = tmp_path / "weights.png"
    fig = heatmap(book_trace, "weights", path, highlight=(1, 1))
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 200
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    (ax,) = _image_axes(fig)
    assert ax.get_xlabel() == "key" and ax.get_ylabel() == "query"
    assert [t.get_text() for t in ax.get_xticklabels()] == list(a.BOOK_TOKENS)
    assert [t.get_text() for t in ax.get_yticklabels()] == list(a.BOOK_TOKENS)


def test_heatmap_svg_has_svg_root(book_trace, tmp_path):
    path = tmp_path / "scores.svg"
    heatmap(book_trace, "scores", path)
    root = ET.fromstring(path.read_bytes())
    assert root.tag.endswith("svg")


def test_values_written_in_cells_with_two_decimals(book_trace):
    fig = heatmap(book_trace, "weights")
    (ax,) = _image_axes(fig)
    cells = [t.get_text() for t in ax.texts]
    expected = [f"{v:.2f}" for v in book_trace["weights"].flatten().tolist()]
    assert cells == expected
    (ax,) = _image_axes(heatmap(book_trace, "weights", annotate=False))
    assert len(ax.texts) == 0


def test_highlight_outlines_the_cell(book_trace):
    fig = heatmap(book_trace, "scores", highlight=(1, 1))
    (ax,) = _image_axes(fig)
    (box,) = _by_gid(ax, "highlight", Rectangle)
    assert box.get_xy() == (0.5, 0.5) and box.get_width() == 1 and box.get_height() == 1
    assert not box.get_fill()
    assert "journey" in fig.get_suptitle()


@pytest.mark.parametrize("stage", ["masked_scores", "weights"])
def test_causal_masked_cells_are_masked_not_zero(causal_trace, stage):
    fig = heatmap(causal_trace, stage)
    (ax,) = _image_axes(fig)
    data = ax.images[0].get_array()
    future = np.triu(np.ones((6, 6), bool), k=1)
    assert isinstance(data, np.ma.MaskedArray)
    assert (np.ma.getmaskarray(data) == future).all()
    (hatch,) = _by_gid(ax, "masked", PatchCollection)
    assert hatch.get_hatch() == "///" and len(hatch.get_paths()) == future.sum()
    assert fig.legends and "masked" in fig.legends[0].get_texts()[0].get_text()


def test_unmasked_stages_have_no_masked_cells(causal_trace):
    (ax,) = _image_axes(heatmap(causal_trace, "scores"))
    assert not np.ma.getmaskarray(ax.images[0].get_array()).any()


def test_multihead_one_panel_per_head(multihead_trace):
    fig = heatmap(multihead_trace, "weights", batch=1, highlight=(1, 1))
    axes = _image_axes(fig)
    assert [ax.get_title() for ax in axes] == ["head 0", "head 1", "head 2"]
    for h, ax in enumerate(axes):
        expected = multihead_trace["weights"][1, h].double().numpy()
        shown = ax.images[0].get_array()
        np.testing.assert_allclose(shown[~shown.mask], expected[~shown.mask])
        assert len(_by_gid(ax, "highlight", Rectangle)) == 1
    # one shared colour scale: every head uses the same norm
    assert len({(ax.images[0].norm.vmin, ax.images[0].norm.vmax) for ax in axes}) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": "context"}, "expected one of scores"),
        ({"stage": "nonsense"}, "expected one of scores"),
        ({"stage": "masked_scores"}, "for a self trace"),
        ({"stage": "weights", "highlight": (1, 6)}, "highlight key"),
        ({"stage": "weights", "highlight": 1}, "(query, key) pair"),
        ({"stage": "weights", "batch": 1}, "unbatched"),
    ],
)
def test_heatmap_rejects_bad_arguments(book_trace, kwargs, message):
    with pytest.raises(AttnScopeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        heatmap(book_trace, **kwargs)


def test_bad_suffix_and_existing_file(book_trace, tmp_path):
    with pytest.raises(AttnScopeError, match=r"\.png or \.svg"):
        heatmap(book_trace, "weights", tmp_path / "weights.jpg")
    with pytest.raises(AttnScopeError, match=r"\.png or \.svg"):
        pipeline_figure(book_trace, tmp_path / "pipeline")
    path = tmp_path / "weights.png"
    path.write_bytes(b"keep me")
    with pytest.raises(AttnScopeError, match="existing"):
        heatmap(book_trace, "weights", path)
    assert path.read_bytes() == b"keep me"
    heatmap(book_trace, "weights", path, overwrite=True)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_trace_plot_door(book_trace, tmp_path):
    book_trace.plot("scores", str(tmp_path / "door.png"), highlight=(1, 1))
    assert (tmp_path / "door.png").read_bytes().startswith(PNG_MAGIC)


def test_user_labels_are_text_not_markup_or_math(tmp_path):
    labels = ["<script>alert(1)</script>", "$x", "--> &amp;"]
    t = a.trace("simplified", torch.rand(3, 2), labels=labels)
    path = tmp_path / "labels.svg"
    fig = heatmap(t, "scores", path)
    (ax,) = _image_axes(fig)
    assert [x.get_text() for x in ax.get_xticklabels()] == ["<script>alert…", "$x", "--> &amp;"]
    svg = path.read_text()
    root = ET.fromstring(svg)  # well-formed: the labels did not break the markup
    assert not [e for e in root.iter() if e.tag.endswith("script")]
    assert "<script>" not in svg and "&lt;script&gt;" in svg


def _box_gids(fig):
    return {p.get_gid() for p in fig.axes[0].patches if isinstance(p, FancyBboxPatch)}


def _texts(fig):
    return "\n".join(t.get_text() for t in fig.axes[0].texts)


def test_pipeline_figure_self(book_trace, tmp_path):
    path = tmp_path / "pipeline.png"
    fig = pipeline_figure(book_trace, path)
    assert _box_gids(fig) == {
        f"box-{n}"
        for n in ["inputs", "W_query", "W_key", "W_value", "queries", "keys", "values"]
        + ["scores", "scaled_scores", "weights", "context"]
    }
    text = _texts(fig)
    for title in ["inputs X", "W_query", "queries", "scaled_scores", "weights", "context Z"]:
        assert title in text
    assert "shape (6, 3)" in text and "shape (6, 2)" in text and "shape (6, 6)" in text
    # real values: the first row of the weights, two decimals
    first = " ".join(f"{v:.2f}" for v in book_trace["weights"][0].tolist())
    assert first in text
    assert matplotlib.image.imread(path)[..., :3].std() > 0.05


def test_pipeline_figure_every_kind(causal_trace, multihead_trace, tmp_path):
    simplified = a.trace("simplified", a.book_embeddings())
    assert _box_gids(pipeline_figure(simplified)) == {
        "box-inputs",
        "box-scores",
        "box-weights",
        "box-context",
    }
    assert "box-masked_scores" in _box_gids(pipeline_figure(causal_trace))
    fig = pipeline_figure(multihead_trace, batch=1)
    assert {"box-masked_scores", "box-output"} <= _box_gids(fig)
    assert "shape (2, 3, 6, 2)" in _texts(fig) and "shape (2, 6, 6)" in _texts(fig)
    path = tmp_path / "pipeline.svg"
    pipeline_figure(causal_trace, path)
    assert ET.fromstring(path.read_bytes()).tag.endswith("svg")


def test_big_traces_skip_values_and_annotations():
    torch.manual_seed(0)
    t = a.MultiHeadAttention(4, 8, 40, 0.0, num_heads=2).trace(torch.rand(40, 4))
    (ax, _) = _image_axes(heatmap(t, "weights"))
    assert len(ax.texts) == 0
    assert "0." not in _texts(pipeline_figure(t)).split("shape (40, 4)")[0].split("inputs X")[1]


def test_missing_matplotlib_says_how_to_install(book_trace, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(AttnScopeError, match=r"pip install attnscope\[plot\]"):
        heatmap(book_trace)
    with pytest.raises(AttnScopeError, match=r"pip install attnscope\[plot\]"):
        pipeline_figure(book_trace)


def test_figures_leave_pyplot_alone(book_trace):
    from matplotlib._pylab_helpers import Gcf

    before = Gcf.get_num_fig_managers()
    fig = heatmap(book_trace)
    # drawn on its own Agg canvas, never registered with pyplot's figure manager
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"
    assert Gcf.get_num_fig_managers() == before
