"""Pictures, reports and text of modern layers: windows, ALiBi, grouped heads, norms, RoPE.

A sliding window's hidden cells are hatched like the future's and the legend says so; an
ALiBi layer's heatmaps name the bias and each head's slope; the pipeline figure grows boxes
for the norms, the rotations and the bias; the HTML report and the text show the new
stages, in the stages table, the heatmaps and the single-query walk.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch

import attnscope as a
import attnscope.functional as AF
from attnscope.render.figures import heatmap, layer_features, pipeline_figure, slope_text
from attnscope.render.html import trace_html
from attnscope.render.text import trace_text

pytest.importorskip("matplotlib")
from matplotlib.collections import PatchCollection  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

X = a.book_embeddings()
WINDOW = 3


def _gqa(**options) -> a.GroupedQueryAttention:
    torch.manual_seed(0)
    return a.GroupedQueryAttention(3, 16, options.pop("heads", 4), options.pop("kv", 2), **options)


@pytest.fixture(scope="module")
def window_trace():
    return _gqa(window=WINDOW).trace(X, labels=a.BOOK_TOKENS)


@pytest.fixture(scope="module")
def alibi_trace():
    return _gqa(heads=8, alibi=True).trace(X, labels=a.BOOK_TOKENS)


@pytest.fixture(scope="module")
def full_trace():
    """Everything a modern layer may add: QK norm, RoPE, ALiBi is exclusive of RoPE so not
    here; a window."""
    return _gqa(qk_norm="per-head", window=WINDOW).trace(X, labels=a.BOOK_TOKENS)


def _image_axes(fig):
    return [
        ax for ax in fig.axes if ax.images and ax.get_visible() and ax.get_label() != "<colorbar>"
    ]


def _hatch(ax):
    return [c for c in ax.collections if c.get_gid() == "masked" and isinstance(c, PatchCollection)]


def _hidden_by_rule(tokens: int, window: int | None) -> np.ndarray:
    i, j = np.arange(tokens)[:, None], np.arange(tokens)[None, :]
    hidden = j > i
    return hidden | (i - j >= window) if window is not None else hidden


# --- heatmaps -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["masked_scores", "weights"])
def test_window_cells_are_hatched_like_the_future(window_trace, stage):
    fig = heatmap(window_trace, stage)
    axes = _image_axes(fig)
    assert len(axes) == 4
    want = _hidden_by_rule(6, WINDOW)
    assert want.sum() > _hidden_by_rule(6, None).sum()  # the window hides more than causal
    for ax in axes:
        assert (np.ma.getmaskarray(ax.images[0].get_array()) == want).all()
        (hatch,) = _hatch(ax)
        assert hatch.get_hatch() == "///" and len(hatch.get_paths()) == want.sum()
    legend = fig.legends[0].get_texts()[0].get_text()
    assert "outside the window" in legend and str(WINDOW) in legend


def test_without_a_window_the_legend_says_nothing_of_one():
    fig = heatmap(_gqa().trace(X), "masked_scores")
    legend = fig.legends[0].get_texts()[0].get_text()
    assert "masked" in legend and "window" not in legend
    (ax, *_) = _image_axes(fig)
    assert (np.ma.getmaskarray(ax.images[0].get_array()) == _hidden_by_rule(6, None)).all()


def test_grouped_panels_name_their_kv_head(window_trace):
    titles = [ax.get_title() for ax in _image_axes(heatmap(window_trace, "scores"))]
    assert titles == ["head 0 (kv head 0)", "head 1 (kv head 0)", "head 2 (kv head 1)"] + [
        "head 3 (kv head 1)"
    ]


def test_biased_scores_heatmap_says_the_bias(alibi_trace):
    fig = heatmap(alibi_trace, "biased_scores")
    axes = _image_axes(fig)
    slopes = alibi_trace.module.alibi_slopes.tolist()
    assert [ax.get_title() for ax in axes] == [
        f"head {h} (kv head {h // 4}), ALiBi slope 1/{2 ** (h + 1)}" for h in range(8)
    ]
    assert "ALiBi" in fig.get_suptitle() and "slope" in fig.get_suptitle()
    for h, ax in enumerate(axes):
        shown = ax.images[0].get_array()
        np.testing.assert_allclose(shown, alibi_trace["biased_scores"][h].double().numpy())
    # what is drawn is the scaled scores plus -slope * distance
    bias = alibi_trace["biased_scores"] - alibi_trace["scaled_scores"]
    d = torch.arange(6.0)
    for h, slope in enumerate(slopes):
        torch.testing.assert_close(bias[h], -slope * (d[:, None] - d[None, :]).abs())
    # before the bias, no slope is named
    scaled = heatmap(alibi_trace, "scaled_scores")
    assert "ALiBi" not in scaled.get_suptitle()
    assert all("slope" not in ax.get_title() for ax in _image_axes(scaled))


def test_slope_text_names_powers_of_two():
    assert [slope_text(s) for s in (0.5, 1 / 256, 0.3, 2**-0.5)] == ["1/2", "1/256", "0.3", "0.707"]


# --- the pipeline figure -----------------------------------------------------------------------


def _boxes(fig) -> dict[str, FancyBboxPatch]:
    return {
        p.get_gid().removeprefix("box-"): p
        for p in fig.axes[0].patches
        if isinstance(p, FancyBboxPatch)
    }


def _texts(fig):
    return "\n".join(t.get_text() for t in fig.axes[0].texts)


def test_pipeline_grows_boxes_for_norms_rotations_and_window(full_trace):
    fig = pipeline_figure(full_trace)
    boxes = _boxes(fig)
    for stage in full_trace.stages:
        assert stage in boxes, stage
    assert "biased_scores" not in boxes
    # left to right: projection, norm, rotation, scores; the chain after the scores
    x = {name: b.get_x() for name, b in boxes.items()}
    assert x["queries"] < x["normed_queries"] < x["rotated_queries"] < x["scores"]
    assert x["keys"] < x["normed_keys"] < x["rotated_keys"] < x["scores"]
    assert x["scores"] < x["scaled_scores"] < x["masked_scores"]
    text = _texts(fig)
    assert "split into 2 kv heads" in text and "kv head 0 of 2" in text
    assert "head 0 of 4" in text  # queries keep their own heads
    assert "RMSNorm per head" in text and "RoPE" in text and "3+ back" in text
    # the values shown are the real ones: head 0 of the rotated queries, first row
    first = " ".join(f"{v:.2f}" for v in full_trace["rotated_queries"][0, 0].tolist())
    assert re.sub(r"\s+", " ", first) in re.sub(r"\s+", " ", text)
    assert "2 kv heads" in fig.axes[0].texts[-1].get_text()


def test_pipeline_grows_a_bias_box_for_alibi(alibi_trace):
    fig = pipeline_figure(alibi_trace)
    boxes = _boxes(fig)
    assert "biased_scores" in boxes and "rotated_queries" not in boxes
    x = {name: b.get_x() for name, b in boxes.items()}
    assert x["scaled_scores"] < x["biased_scores"] < x["masked_scores"]
    assert "ALiBi" in _texts(fig)


def test_book_pipeline_is_unchanged_by_the_modern_boxes():
    torch.manual_seed(123)
    tr = a.SelfAttentionV1(3, 2).trace(X)
    assert set(_boxes(pipeline_figure(tr))) == {
        "inputs",
        "W_query",
        "W_key",
        "W_value",
        "queries",
        "keys",
        "values",
        "scores",
        "scaled_scores",
        "weights",
        "context",
    }
    assert layer_features(tr) == []


def test_layer_features_say_what_the_layer_adds(full_trace, alibi_trace):
    assert layer_features(full_trace) == [
        "2 kv heads, each shared by 2 query heads",
        "QK norm (per-head)",
        "RoPE (half pairing)",
        "sliding window of 3 keys",
    ]
    assert layer_features(alibi_trace)[-1] == "ALiBi (slopes 1/2 .. 1/256)"
    partial = _gqa(heads=2, kv=2, rope_fraction=0.5, rope_pairing="interleaved").trace(X)
    assert layer_features(partial) == ["RoPE (interleaved pairing, 4 of 8 features)"]


# --- HTML --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alibi4_trace():
    """Four heads with ALiBi (slopes 1/4, 1/16, 1/64, 1/256): a cheaper report to draw."""
    return _gqa(alibi=True).trace(X, labels=a.BOOK_TOKENS)


@pytest.fixture(scope="module")
def alibi_page(alibi4_trace):
    return trace_html(alibi4_trace, token=2)


def test_html_report_has_the_new_stages_everywhere(alibi4_trace, alibi_page):
    page = alibi_page
    for check in alibi4_trace.shape_checks():
        assert f"<td><code>{check.stage.value}</code></td>" in page
    assert 'alt="heatmap of biased_scores"' in page
    assert page.count('class="heatmap"') == 5  # scores, scaled, biased, masked, weights
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    biased = next(c for c in captions if c.startswith("<code>biased_scores"))
    assert "ALiBi" in biased and "slopes 1/4, 1/16, 1/64, 1/256" in biased
    # the walk: one row per head for the biased scores, between scaled and masked
    walk = page.split("Single query: token 2")[1]
    rows = re.findall(r"<tr><th>([a-z_]+), head 0</th>", walk)
    assert rows == ["query", "scores", "scaled_scores", "biased_scores", "masked_scores", "weights"]
    assert "ALiBi (slopes 1/4 .. 1/256)" in page


def test_html_walk_biased_row_is_the_walks_own(alibi4_trace, alibi_page):
    walk = alibi4_trace.walk(2)
    page = alibi_page
    row = page.split("<tr><th>biased_scores, head 0</th>")[1].split("</tr>")[0]
    cells = [float(c) for c in re.findall(r"<td>(-?[0-9.]+)</td>", row)]
    np.testing.assert_allclose(cells, walk.biased_scores[0].double().numpy(), atol=1e-4)


def test_html_window_caption_and_tables_without_matplotlib(window_trace, monkeypatch):
    page = trace_html(window_trace)
    masked = next(
        c
        for c in re.findall(r"<figcaption>(.*?)</figcaption>", page)
        if c.startswith("<code>masked_scores")
    )
    assert "outside the window" in masked
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = trace_html(window_trace)
    after = page.split("<code>masked_scores, head 0 (kv head 0)</code>")[1]
    table = after.split("</table>")[0]
    assert table.count('class="masked"') == int(_hidden_by_rule(6, WINDOW).sum())
    assert "outside the window" in after.split("<table")[0]


# --- text --------------------------------------------------------------------------------------


def test_trace_text_shows_the_layer_and_the_new_stages(alibi_trace, full_trace):
    text = trace_text(alibi_trace, color=False, token=1)
    assert "layer: 2 kv heads, each shared by 4 query heads; ALiBi" in text
    assert "\n  biased_scores (8, 6, 6)" in text
    walk = text.split("walk: token 1")[1]
    order = [walk.index(f"\n  {name}") for name in ("scaled_scores", "biased_scores", "masked")]
    assert order == sorted(order)
    text = trace_text(full_trace, color=False)
    for stage in ("normed_queries", "normed_keys", "rotated_queries", "rotated_keys"):
        assert f"\n  {stage} (" in text
    assert "sliding window of 3 keys" in text


def test_walk_biased_scores_are_scaled_plus_bias(alibi_trace):
    walk = alibi_trace.walk(3)
    bias = AF.alibi_bias(alibi_trace.module.alibi_slopes, 6)[:, 3].float()
    torch.testing.assert_close(walk.biased_scores, walk.scaled_scores + bias)


def test_cross_attention_keys_are_the_other_sequences(monkeypatch):
    """Keys from a sequence of another length: columns named ``ctx j``, walk and reports
    one column per key, a highlight bounded by the keys."""
    torch.manual_seed(0)
    layer = a.GroupedQueryAttention(3, 8, 2, 1, cross=True)
    tr = layer.trace(X, labels=a.BOOK_TOKENS, context=torch.rand(4, 3))
    fig = heatmap(tr, "weights", highlight=(5, 3))
    ax = _image_axes(fig)[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ctx 0", "ctx 1", "ctx 2", "ctx 3"]
    assert "“ctx 3”" in fig.get_suptitle()
    with pytest.raises(a.AttnScopeError, match="highlight key"):
        heatmap(tr, "weights", highlight=(1, 4))
    text = trace_text(tr, color=False, token=1)
    assert "cross-attention to 4 tokens" in text
    assert re.search(r"\n +ctx 0 +ctx 1 +ctx 2 +ctx 3\n", text.split("walk: token 1")[1])
    page = trace_html(tr, token=1)
    assert "<tr><th>weights, head 1</th>" in page and "Single query: token 1" in page
    texts = _texts(pipeline_figure(tr))
    assert "context @ W_key, split into 1 kv head\n" in texts
    assert "x @ W_query, split into 2 heads" in texts
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    tables = trace_html(tr)
    assert tables.count("<th>ctx 3</th>") >= 4  # scores, scaled, weights per head, the walk
