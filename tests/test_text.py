"""Text rendering: values to 4 decimals, traces, the check checklist, demo steps, colour."""

from __future__ import annotations

import io

import pytest
import torch

import attnscope
from attnscope.checking.report import CheckReport, Failure, StageCheck
from attnscope.demo import Check, run_demo
from attnscope.render.text import (
    check_text,
    demo_text,
    format_tensor,
    format_values,
    step_text,
    trace_text,
    use_color,
)
from attnscope.stages import Stage

ANSI = "\x1b["


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_color_is_on_for_a_terminal_and_off_when_piped_or_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(None, _Tty()) is True
    assert use_color(None, io.StringIO()) is False
    monkeypatch.setenv("NO_COLOR", "1")
    assert use_color(None, _Tty()) is False
    assert use_color(True, io.StringIO()) is True  # an explicit choice wins


def test_auto_color_follows_sys_stdout(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    tr = attnscope.trace("simplified", attnscope.book_embeddings())
    monkeypatch.setattr("sys.stdout", _Tty())
    assert ANSI in trace_text(tr)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert ANSI not in trace_text(tr)


def test_format_tensor_prints_four_decimals_with_labels():
    assert format_tensor(torch.tensor([0.43061, 1.45512])) == "0.4306  1.4551"
    text = format_tensor(torch.tensor([[1.0, -torch.inf], [0.5, 0.25]]), ["a", "b"], ["a", "b"])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b"]
    assert lines[1].split() == ["a", "1.0000", "-inf"]
    assert lines[2].split() == ["b", "0.5000", "0.2500"]


def test_format_tensor_summarises_large_tensors_and_splits_heads():
    big = format_tensor(torch.zeros(20, 20))
    assert "(20, 20)" in big and "too large" in big
    heads = format_tensor(torch.zeros(2, 2, 2))
    assert "head 0:" in heads and "head 1:" in heads


def test_trace_text_lists_every_stage_with_predicted_and_actual_shapes():
    torch.manual_seed(123)
    tr = attnscope.SelfAttentionV1(3, 2).trace(
        attnscope.book_embeddings(), labels=attnscope.BOOK_TOKENS
    )
    text = trace_text(tr, color=False, token=1)
    for stage in tr:
        assert stage in text
    assert "one row per query, one column per key" in text  # the rule
    assert "(6, 6)" in text and "(6, 2)" in text
    assert "0.4306  1.4551" in text  # the walk's query for "journey"
    assert "pass" in text and "FAIL" not in text and ANSI not in text


def test_trace_text_shows_batch_zero_of_a_batched_trace():
    x = torch.stack((attnscope.book_embeddings(), attnscope.book_embeddings()))
    text = trace_text(attnscope.trace("simplified", x), color=False)
    assert "(batch 0 of 2)" in text


def _report(checks: list[StageCheck], failure: Failure | None) -> CheckReport:
    return CheckReport(
        ok=failure is None,
        kind="causal",
        target="mine.py:Attn",
        first_failure=failure,
        checks=checks,
        kind_reason="it has a mask buffer",
        notes=["probe: 2 sequences of 7 tokens"],
    )


def test_check_text_stops_at_the_first_failing_stage_and_names_the_mistake():
    checks = [
        StageCheck(Stage.QUERIES, True, "matches", (2, 7, 4), (2, 7, 4)),
        StageCheck(Stage.SCALED_SCORES, False, "not divided by sqrt(d_k)", (2, 7, 7), (2, 7, 7)),
        StageCheck(Stage.WEIGHTS, False, "differs", (2, 7, 7), (2, 7, 7)),
    ]
    failure = Failure(Stage.SCALED_SCORES, "missing_scale", "scores not scaled", "mine.py:12")
    text = check_text(_report(checks, failure), color=False)
    assert "queries" in text and "scaled_scores" in text
    assert "weights" not in text.split("first failure")[0]  # nothing after the first FAIL
    assert "FAIL" in text and "missing_scale" in text and "mine.py:12" in text
    assert "causal" in text and "it has a mask buffer" in text
    assert "probe: 2 sequences of 7 tokens" in text
    assert "FAILED" in text


@pytest.mark.parametrize(
    ("message", "at_lines"),
    [("scores not scaled. Look at mine.py:12", 0), ("scores not scaled", 1)],
)
def test_check_text_names_the_failure_location_once(message, at_lines):
    checks = [StageCheck(Stage.SCALED_SCORES, False, "not divided", (7, 7), (7, 7))]
    failure = Failure(Stage.SCALED_SCORES, "missing_scale", message, "mine.py:12")
    text = check_text(_report(checks, failure), color=False)
    assert text.count("mine.py:12") == 1
    assert sum(line.strip().startswith("at ") for line in text.splitlines()) == at_lines


def test_format_values_caps_long_vectors():
    assert format_values(torch.tensor([0.5, 1.0])) == "0.5000 1.0000"
    long = format_values(torch.arange(128.0))
    assert long == (
        "0.0000 1.0000 2.0000 3.0000 ... 124.0000 125.0000 126.0000 127.0000 (128 values)"
    )


def test_check_text_of_a_passing_report_says_ok():
    checks = [StageCheck(Stage.WEIGHTS, True, "matches", (7, 7), (7, 7))]
    text = check_text(_report(checks, None), color=False)
    assert "OK" in text and "FAIL" not in text and "first failure" not in text


def test_check_report_to_text_uses_this_renderer():
    report = _report([StageCheck(Stage.WEIGHTS, True, "matches", None, None)], None)
    assert report.to_text(color=False) == check_text(report, color=False)


def test_demo_text_shows_prediction_shapes_values_and_a_summary():
    result = run_demo("self")
    text = demo_text(result, color=False)
    assert "Predict:" in text
    assert "0.2996  0.8053" in text
    assert f"all {len(result.checks)} checks passed" in text


def test_demo_text_lists_failed_checks_in_the_summary():
    result = run_demo("simplified")
    result.steps[0].checks.append(Check("an impossible check", False, "injected"))
    text = demo_text(result, color=False)
    assert "FAIL" in text and "an impossible check" in text.split("checks failed")[1]


@pytest.mark.parametrize("color", [True, False])
def test_step_text_marks_pass_and_fail(color):
    step = run_demo("simplified").steps[0]
    text = step_text(step, 1, color=color)
    assert "1. One query against every token" in text
    assert (ANSI in text) is color
