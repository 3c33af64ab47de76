"""HTML reports: self-contained, escaped, with the stages table, figures and the failure."""

from __future__ import annotations

import re
import sys

import pytest
import torch

import attnscope as a
from attnscope import AttnScopeError, Stage
from attnscope.checking.report import CheckReport, Failure, StageCheck
from attnscope.render.html import check_html, trace_html

EVIL = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


def assert_self_contained(page: str) -> None:
    """Nothing is fetched: no URLs, protocol-relative sources or scripts of any kind."""
    lowered = page.lower()
    for needle in ("http://", "https://", 'src="//', "src='//", "<script", "@import", "url("):
        assert needle not in lowered, needle
    for src in re.findall(r'src="([^"]*)"', page):
        assert src.startswith("data:image/png;base64,"), src[:40]


@pytest.fixture(scope="module")
def causal_trace():
    torch.manual_seed(123)
    labels = [EVIL, "journey", "starts", "with", "one", "step"]
    return a.CausalAttention(3, 2, 6, 0.0).trace(a.book_embeddings(), labels=labels)


@pytest.fixture(scope="module")
def small_trace():
    """Two tokens, no projections: the cheapest trace to render (three figures)."""
    return a.trace("simplified", torch.tensor([[1.0, 0.0], [0.5, 0.5]]), labels=[EVIL, "b"])


@pytest.fixture(scope="module")
def trace_page(causal_trace):
    checks = [("weights rows sum to 1", True, "max |sum - 1| = 0"), ("a <b>", False, "x < y")]
    return trace_html(causal_trace, checks=checks, full_page=True)


def failing_report() -> CheckReport:
    """A causal check that fails at masked_scores: -1e9 fills instead of -inf."""
    torch.manual_seed(1)
    t = a.CausalAttention(3, 2, 6, 0.0).trace(a.book_embeddings())
    reference = t["masked_scores"].double()
    observed = reference.masked_fill(torch.isinf(reference), -1e9)
    return CheckReport(
        ok=False,
        kind="causal",
        target="my_attention.py:Attention",
        first_failure=Failure(
            Stage.MASKED_SCORES,
            "mask_fill_value",
            f"masked_scores: `scores.masked_fill(mask, -1e9)` leaves weight on {EVIL}",
            "my_attention.py:17",
        ),
        checks=[
            StageCheck(Stage.QUERIES, True, "queries = x @ W_query", (6, 2), (6, 2), "a.py:9"),
            StageCheck(Stage.SCORES, True, "scores match", (6, 6), (6, 6)),
            StageCheck(
                Stage.MASKED_SCORES,
                False,
                "masked cells hold -1e9, not -inf",
                (6, 6),
                (6, 6),
                "my_attention.py:17",
                reference,
                observed,
            ),
        ],
        kind_reason="the module registers a causal mask buffer",
        notes=["weights stored (d_in, d_out)"],
    )


def test_trace_page_is_self_contained_and_complete(trace_page, causal_trace):
    assert trace_page.startswith("<!doctype html>")
    assert_self_contained(trace_page)
    assert 'http-equiv="Content-Security-Policy"' in trace_page
    for check in causal_trace.shape_checks():
        assert f"<td><code>{check.stage.value}</code></td>" in trace_page
        assert f'<td class="num">{check.predicted}</td>' in trace_page
    assert "predicted shape" in trace_page and "actual shape" in trace_page
    assert trace_page.count('class="heatmap"') == 4  # scores, scaled, masked, weights
    assert 'class="pipeline"' in trace_page
    assert "Single query: token 1 “journey”" in trace_page
    assert "weights rows sum to 1" in trace_page and "a &lt;b&gt;" in trace_page


def test_user_labels_are_escaped(trace_page):
    assert EVIL not in trace_page
    assert ESCAPED in trace_page


def test_fragment_for_notebooks(small_trace):
    fragment = small_trace._repr_html_()
    assert fragment.startswith('<div class="attnscope">') and fragment.endswith("</div>")
    assert "<html" not in fragment and "<!doctype" not in fragment
    assert_self_contained(fragment)
    # the styles are scoped to the report, so they cannot restyle a notebook
    css = re.search(r"<style>(.*?)</style>", fragment, re.S).group(1)
    selectors = [
        s.strip() for rule in css.split("}") if "{" in rule for s in rule.split("{")[0].split(",")
    ]
    assert selectors and all(s.startswith(".attnscope") for s in selectors)


def test_written_page_refuses_to_overwrite(small_trace, tmp_path):
    path = tmp_path / "trace.html"
    small_trace.to_html(str(path))
    assert path.read_text(encoding="utf-8").startswith("<!doctype html>")
    with pytest.raises(AttnScopeError, match="existing"):
        trace_html(small_trace, path)
    trace_html(small_trace, path, overwrite=True, title="again")
    assert "<title>again</title>" in path.read_text(encoding="utf-8")


def test_without_matplotlib_matrices_are_tables(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    torch.manual_seed(0)
    t = a.CausalAttention(3, 2, 4, 0.0).trace(torch.rand(4, 3), labels=list("abcd"))
    page = trace_html(t)
    assert "<img" not in page and "pip install attnscope[plot]" in page
    assert page.count('<table class="matrix">') >= 4
    # the causal weights: 6 masked cells above the diagonal in the heatmap table
    weights = page.split("<code>weights</code> (rows: queries")[1].split("</table>")[0]
    assert weights.count('class="masked"') == 6
    assert_self_contained(page)
    # long sequences: no 40-column tables of numbers
    long = trace_html(a.trace("simplified", torch.rand(40, 2)))
    assert "too many for tables" in long and "too many to list" in long
    assert '<table class="matrix">' in long  # the query and context vectors still are


def test_the_walk_is_of_the_token_asked_for(causal_trace):
    page = trace_html(causal_trace, token=3)
    assert "Single query: token 3 “with”" in page and "row 3 of the batched context" in page
    assert "Single query: token 1" in trace_html(causal_trace)
    assert "Single query" not in trace_html(causal_trace, token=None)
    with pytest.raises(AttnScopeError, match="token: expected a position from 0 to 5"):
        trace_html(causal_trace, token=6)


def test_single_token_trace_has_no_walk():
    t = a.trace("simplified", torch.rand(1, 2))
    page = trace_html(t)
    assert "Single query" not in page
    assert "<h2>Stages</h2>" in page


def test_check_report_shows_first_failure_side_by_side():
    page = failing_report().to_html()
    assert_self_contained(page)
    assert EVIL not in page and ESCAPED in page
    failure = page.split('<section class="failure" id="first-failure">')[1].split("</section>")[0]
    assert "First failure: <code>masked_scores</code>" in failure
    assert "mask_fill_value" in failure
    assert "masked_scores: `scores.masked_fill(mask, -1e9)` leaves weight on" in failure
    assert "my_attention.py:17" in failure
    for column in ("reference", "your code", "difference (yours − reference)"):
        assert f"<h3>{column}</h3>" in failure
    assert "−inf" in failure and "-1e+09" in failure and ">inf<" in failure
    assert 'class="heatmap"' in failure
    # the failing stage is marked in the stages table
    assert '<tr class="failing"><td><code>masked_scores</code></td>' in page
    assert "the module registers a causal mask buffer" in page
    assert "weights stored (d_in, d_out)" in page


def test_check_report_names_the_failure_location_once():
    report = failing_report()
    assert "look at <code>my_attention.py:17</code>" in report.to_html()
    report.first_failure.message += " Look at my_attention.py:17"
    page = report.to_html()
    failure = page.split('<section class="failure" id="first-failure">')[1].split("<h3>")[0]
    assert failure.count("my_attention.py:17") == 1


def test_check_report_not_observed_and_passing(tmp_path):
    reference = torch.rand(4, 2, dtype=torch.float64)
    report = CheckReport(
        ok=False,
        kind="self",
        target="x.py:A",
        first_failure=Failure(Stage.CONTEXT, "other", "context was never computed"),
        checks=[StageCheck(Stage.CONTEXT, False, "not seen", (4, 2), None, None, reference)],
    )
    page = check_html(report, tmp_path / "check.html")
    assert page.startswith("<!doctype html>")
    assert "not observed" in page and "context was never computed" in page
    assert "<h3>difference" not in page and "heatmaps of reference" in page
    passing = CheckReport(True, "self", "x.py:B", None, [StageCheck(Stage.CONTEXT, True, "ok")])
    page = passing._repr_html_()
    assert "Matches the reference at every stage" in page and "first-failure" not in page


def test_check_report_shape_mismatch_has_no_difference():
    report = CheckReport(
        ok=False,
        kind="self",
        target="t",
        first_failure=Failure(Stage.SCORES, "scores_transposed", "scores are (2, 3)"),
        checks=[
            StageCheck(
                Stage.SCORES,
                False,
                "shape differs",
                (3, 3),
                (2, 3),
                None,
                torch.zeros(3, 3, dtype=torch.float64),
                torch.ones(2, 3, dtype=torch.float64),
            )
        ],
    )
    page = check_html(report)
    assert "The shapes differ" in page and "difference (yours" not in page


class NoScale(torch.nn.Module):
    """The book's V1 with one bug: the scores are never divided by sqrt(d_k)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.W_query = torch.nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = torch.nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = torch.nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        queries, keys, values = x @ self.W_query, x @ self.W_key, x @ self.W_value
        scores = queries @ keys.transpose(-2, -1)
        return torch.softmax(scores, dim=-1) @ values  # missing: / keys.shape[-1] ** 0.5


def test_report_of_the_real_checker():
    from attnscope.checking import check

    report = check(NoScale)
    assert report.first_failure.stage is Stage.SCALED_SCORES
    page = report.to_html()
    assert_self_contained(page)
    failure = page.split('id="first-failure">')[1].split("</section>")[0]
    assert "First failure: <code>scaled_scores</code>" in failure
    assert "missing_scale" in failure and "test_html.py:" in failure
    assert failure.count('<table class="matrix">') == 3  # reference, yours, difference
    assert 'class="heatmap"' in failure


def test_model_report_grid_has_a_decoding_column():
    """Per layer: pass, the first diverging step with its code, or not reached; the
    decoding failure's message and line below the grid."""
    from conftest import GALLERY

    from attnscope import check

    models = GALLERY / "models"
    page = check(f"{models / 'buggy_cache_stale_updated_twice.py'}:make_model").to_html()
    assert '<th class="decode">decoding</th>' in page
    assert page.count('<td class="decode') == 3
    assert "✗ step 0</span> <code>cache_stale</code>" in page
    assert page.count("not reached") == 2
    assert 'id="decode"' in page and "held twice" in page
    assert "FAILED in decoding (cache_stale at step 0)" in page and "None" not in page
    assert "buggy_cache_stale_updated_twice.py:" in page
    ok = check(f"{models / 'correct_gpt_external_cache.py'}:make_model").to_html()
    assert ok.count('<td class="decode"') == 3 and "8 cached steps equal the full pass" in ok
    later_layer = check(f"{GALLERY / 'models' / 'buggy_last_layer_wrong_scale.py'}:make_model")
    assert "First failing layer" in later_layer.to_html() and "decoding" in later_layer.to_html()
