"""The attnscope command: demo, trace, plot and check, run in-process through main(argv)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnscope
from attnscope.checking.report import CheckReport, Failure, StageCheck
from attnscope.cli import main
from attnscope.demo import run_demo
from attnscope.stages import Stage

BOOK = attnscope.book_embeddings()
REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- demo ----------------------------------------------------------------------------------------


def test_demo_default_walks_simplified_then_self_with_the_books_numbers(capsys):
    code, out, err = run_cli(capsys, "demo")
    assert code == 0, out + err
    for numbers in [
        "0.9544   1.4950   1.4754   0.8434   0.7070   1.0865",  # simplified scores
        "0.1455   0.2278   0.2249   0.1285   0.1077   0.1656",  # divided by the sum
        "0.1385   0.2379   0.2333   0.1240   0.1082   0.1581",  # softmax
        "0.4419  0.6515  0.5683",  # simplified context of "journey"
        "0.1250  0.6250  0.2500",  # toy, by the sum
        "0.0171  0.9362  0.0466",  # toy, softmax
        "0.4306  1.4551",  # query_2
        "1.2705   1.8524   1.8111   1.0795   0.5577   1.5440",  # scores
        "0.1500   0.2264   0.2199   0.1311   0.0906   0.1820",  # weights
        "0.3061  0.8210",  # context_vec_2
        "0.2996  0.8053",  # V1 first output row
        "-0.0739   0.0713",  # V2 (seed 789) first row
    ]:
        assert numbers in out, numbers
    # in the seeds' order: simplified, the toy scores, then trainable weights
    assert out.index("0.9544") < out.index("0.9362") < out.index("0.4306") < out.index("-0.0739")
    assert "Predict:" in out and "FAIL" not in out and "checks passed" in out
    for check in [
        "the loop and torch.dot agree",
        "the naive and the stable softmax agree on small scores",
        "the naive softmax overflows on large scores, the stable one does not",
        "weights are positive and each row sums to 1",
        "the output has one row per token and d_out columns",
        "the single-token context vector equals its row of the batched output",
        "the forward pass reads the weight parameters and leaves them unchanged",
        "the attention weights change with the input",
    ]:
        assert f"pass  {check}" in out, check
    assert "Causal" not in out and "Multi-head" not in out
    assert err == ""


def test_demo_causal_masks_the_future_and_shows_dropout(capsys):
    code, out, _ = run_cli(capsys, "demo", "--kind", "causal")
    assert code == 0
    assert "-inf" in out and "-0.4519   0.2216" in out
    assert "dropout zeroes entries and scales the kept ones by 1/(1-p) in training mode" in out
    assert "0.9544" not in out  # only the causal part


def test_demo_causal_multihead_reproduces_the_books_output(capsys):
    code, out, _ = run_cli(capsys, "demo", "--kind", "causal-multihead")
    assert code == 0
    assert "(2, 6, 1)" in out and "0.3190  0.4858" in out
    assert "matches the book: multihead first row" in out and "-inf" in out
    assert "pass  the fast path (scaled_dot_product_attention) equals the explicit stages" in out


def test_demo_multihead_is_not_causal_as_in_trace(capsys):
    """--kind multihead means the same in demo, trace and check: no causal mask."""
    code, out, _ = run_cli(capsys, "demo", "--kind", "multihead")
    assert code == 0, out
    assert "causal=False" in out and "-inf" not in out and "matches the book" not in out
    assert "weights are positive and each row sums to 1" in out
    result = run_demo("multihead")
    assert result.main_trace.kind == "multihead" and "masked_scores" not in result.main_trace


def test_demo_all_walks_every_part(capsys):
    code, out, _ = run_cli(capsys, "demo", "--kind", "all")
    assert code == 0
    assert out.index("Simplified") < out.index("SelfAttentionV1") < out.index("Causal attention")
    assert out.index("Causal attention") < out.index("== Multi-head attention (causal=False")
    assert out.index("== Multi-head") < out.index("== Causal multi-head attention")


def test_demo_another_token_and_seed_change_the_numbers(capsys):
    code, out, _ = run_cli(capsys, "demo", "--kind", "self", "--token", "3", "--seed", "7")
    assert code == 0
    assert "token 3, 'with'" in out
    assert "0.2996  0.8053" not in out and "matches the book" not in out


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".pt"])
def test_demo_and_trace_read_embeddings_files(capsys, tmp_path, suffix):
    data = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.2, -0.3]])
    path = tmp_path / f"emb{suffix}"
    if suffix == ".npy":
        np.save(path, data.numpy())
    elif suffix == ".pt":
        torch.save({"embeddings": data, "labels": ["w", "x", "y", "z"]}, path)
    else:
        path.write_text("w,1,0\nx,0,1\ny,0.5,0.5\nz,0.2,-0.3\n")
    code, out, err = run_cli(capsys, "demo", "--input", str(path))
    assert code == 0, err
    assert "(4, 4)" in out and "(4, 2)" in out
    if suffix != ".npy":
        assert "input: w x y z" in out
    code, out, err = run_cli(capsys, "trace", "--input", str(path), "--kind", "causal")
    assert code == 0, err
    assert "masked_scores  (4, 4)" in out


def test_demo_and_trace_pass_on_embeddings_with_large_scores(capsys, tmp_path):
    """The book's embeddings x20: softmax weights underflow to exactly 0, scores are far
    too large for the naive softmax, and 2x the input would leave the weights one-hot."""
    path = tmp_path / "big.pt"
    torch.save(BOOK * 20, path)
    code, out, err = run_cli(capsys, "demo", "--kind", "all", "--input", str(path))
    assert code == 0, [line for line in out.splitlines() if "FAIL" in line]
    assert "skipped: these scores are not small" in out and "exp underflows float32" in out
    assert "pass  the attention weights change with the input" in out
    code, out, err = run_cli(capsys, "trace", "--kind", "simplified", "--input", str(path))
    assert code == 0, out


def test_demo_long_vectors_are_cut_short_in_check_details(capsys, tmp_path):
    path = tmp_path / "wide.pt"
    torch.save(torch.randn(6, 128, generator=torch.Generator().manual_seed(0)), path)
    code, out, _ = run_cli(capsys, "demo", "--kind", "simplified", "--input", str(path))
    assert code == 0
    walk = next(line for line in out.splitlines() if "single-token context vector" in line)
    assert walk.count("(128 values)") == 2 and len(walk) < 400


def test_run_demo_accepts_labels_that_are_not_strings():
    from attnscope.render.text import demo_text

    result = run_demo("simplified", labels=[1, 2, 3, 4, 5, 6])
    assert result.main_trace.labels == ("1", "2", "3", "4", "5", "6")
    assert "input: 1 2 3 4 5 6" in demo_text(result, color=False)


def test_labels_option_names_the_tokens(capsys):
    code, out, _ = run_cli(capsys, "demo", "--kind", "simplified", "--labels", "a,b,c,d,e,f")
    assert code == 0 and "input: a b c d e f" in out and "(query: token 1, 'b')" in out


def test_demo_writes_html_with_its_checks(capsys, tmp_path, monkeypatch):
    calls = []

    def fake_trace_html(trace, path, *, checks=None, title=None, overwrite=False, token=1):
        calls.append((trace, path, checks, title, overwrite, token))
        Path(path).write_text("<html>")
        return "<html>"

    monkeypatch.setattr("attnscope.render.html.trace_html", fake_trace_html)
    target = tmp_path / "demo.html"
    code, _, err = run_cli(capsys, "demo", "--html", str(target))
    assert code == 0 and "wrote" in err
    trace, path, checks, title, overwrite, token = calls[0]
    assert trace.kind == "self" and path == str(target) and overwrite is False and token == 1
    assert ("the loop and torch.dot agree", True) in [c[:2] for c in checks]
    assert all(isinstance(c, tuple) and len(c) == 3 for c in checks)
    code, _, _ = run_cli(capsys, "demo", "--html", str(target), "--force")
    assert code == 0 and calls[1][4] is True


def test_demo_html_report_is_written_by_the_real_renderer(capsys, tmp_path):
    target = tmp_path / "demo.html"
    code, _, err = run_cli(capsys, "demo", "--kind", "simplified", "--html", str(target))
    assert code == 0, err
    assert "<html" in target.read_text(encoding="utf-8").lower()


# --- trace ---------------------------------------------------------------------------------------


def test_trace_prints_stages_rules_shapes_values_and_the_walk(capsys):
    code, out, err = run_cli(capsys, "trace")
    assert code == 0, err
    assert "attnscope trace: self (SelfAttentionV1, d_in=3, d_out=2), 6 tokens" in out
    assert "scaled_scores  (6, 6)     (6, 6)" in out
    assert "same shape as scores: each score divided by sqrt(d_k)" in out
    assert "0.2996  0.8053" in out  # values are small: printed
    assert "walk: token 1 ('journey') alone" in out
    assert "pass  the single-token context vector equals its row of the batched output" in out
    assert "Predict:" not in out  # no tutorial text


def test_trace_multihead_with_options(capsys):
    code, out, _ = run_cli(
        capsys, "trace", "--kind", "multihead", "--d-out", "4", "--heads", "2", "--token", "0"
    )
    assert code == 0
    assert "queries        (2, 6, 2)" in out and "output         (6, 4)" in out
    assert "masked_scores" not in out
    assert "head 1" in out and "walk: token 0 ('Your')" in out


def test_trace_of_a_batch_shows_batch_zero(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save(torch.stack((BOOK, BOOK.flip(0))), path)
    code, out, _ = run_cli(capsys, "trace", "--input", str(path), "--kind", "causal-multihead")
    assert code == 0
    assert "(batch 0 of 2)" in out and "weights        (2, 2, 6, 6)" in out


def test_trace_summarises_large_inputs(capsys, tmp_path):
    path = tmp_path / "big.npy"
    np.save(path, np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32))
    code, out, _ = run_cli(capsys, "trace", "--input", str(path))
    assert code == 0
    assert "(40, 40): min" in out and "too large to print" in out


def test_trace_html_walks_the_token_asked_for(capsys, tmp_path):
    target = tmp_path / "t.html"
    code, out, err = run_cli(capsys, "trace", "--token", "3", "--html", str(target))
    assert code == 0, err
    assert "walk: token 3 ('with')" in out
    page = target.read_text(encoding="utf-8")
    assert "Single query: token 3 “with”" in page and "Single query: token 1" not in page


# --- plot ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_writes_a_heatmap(capsys, tmp_path, suffix):
    target = tmp_path / f"w{suffix}"
    code, out, err = run_cli(capsys, "plot", "--highlight", "1,1", "-o", str(target))
    assert code == 0, err
    assert target.stat().st_size > 0 and "wrote" in out
    head = target.read_bytes()[:200]
    assert head.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in target.read_bytes()


def test_plot_pipeline_and_masked_scores(capsys, tmp_path):
    code, _, err = run_cli(capsys, "plot", "--pipeline", "-o", str(tmp_path / "p.png"))
    assert code == 0, err
    code, _, err = run_cli(
        capsys,
        "plot",
        "--kind",
        "causal",
        "--stage",
        "masked_scores",
        "-o",
        str(tmp_path / "m.svg"),
    )
    assert code == 0, err
    assert (tmp_path / "p.png").exists() and (tmp_path / "m.svg").exists()


def test_plot_replaces_a_file_only_with_force(capsys, tmp_path):
    target = tmp_path / "w.png"
    target.write_bytes(b"mine")
    code, _, err = run_cli(capsys, "plot", "-o", str(target))
    assert code == 2 and "--force" in err and target.read_bytes() == b"mine"
    code, _, err = run_cli(capsys, "plot", "-o", str(target), "--force")
    assert code == 0, err
    assert target.read_bytes().startswith(b"\x89PNG")


# --- modern attention: demo, trace and plot of a GroupedQueryAttention ---------------------------


def test_demo_rope_and_gqa_predict_then_check(capsys):
    code, out, err = run_cli(capsys, "demo", "--kind", "rope")
    assert code == 0, out + err
    assert "== Rotary position embeddings" in out
    assert re.search(r"rotated_queries +\(2, 6, 8\) +\(2, 6, 8\) +pass", out)
    assert "pass  every pair keeps its length: a rotation" in out
    assert "pass  mixing one layout's tables with the other's rotation changes lengths" in out
    assert "0.9544" not in out  # only the rope part
    code, out, err = run_cli(capsys, "demo", "--kind", "gqa", "--token", "4", "--seed", "5")
    assert code == 0, out + err
    assert re.search(r"keys +\(2, 6, 4\) +\(2, 6, 4\) +pass", out) and "token 4, 'one'" in out
    assert "pass  query i sees min(i + 1, 3) keys, in every head" in out
    assert "pass  the slopes of 8 heads are ALiBi's published 1/2, 1/4, ..., 1/256" in out
    assert "FAIL" not in out


def test_demo_all_ends_with_the_modern_parts(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "demo", "--kind", "all", "--html", str(tmp_path / "d.html"))
    assert code == 0
    assert out.index("== Causal multi-head") < out.index("== Rotary") < out.index("== Grouped")
    page = (tmp_path / "d.html").read_text(encoding="utf-8")
    assert "GroupedQueryAttention" in page and "2 kv heads" in page


def test_trace_gqa_defaults_and_options(capsys):
    code, out, err = run_cli(capsys, "trace", "--kind", "gqa")
    assert code == 0, err
    assert (
        "attnscope trace: causal-multihead (GroupedQueryAttention, d_in=3, d_out=16, 4 heads)"
        in out
    )
    assert "layer: 2 kv heads, each shared by 2 query heads; RoPE (half pairing)" in out
    assert re.search(r"keys +\(2, 6, 4\) +\(2, 6, 4\) +pass", out) and "rotated_keys" in out
    code, out, err = run_cli(
        capsys, "trace", "--kind", "gqa", "--heads", "8", "--kv-heads", "1", "--window", "2"
    )
    assert code == 0, err
    assert re.search(r"keys +\(1, 6, 2\) +\(1, 6, 2\)", out) and "window of 2 keys" in out
    assert "pass  weights are zero above the diagonal and outside the window of 2" in out
    code, out, err = run_cli(capsys, "trace", "--kind", "gqa", "--alibi", "--token", "3")
    assert code == 0, err
    assert re.search(r"biased_scores +\(4, 6, 6\)", out) and "rotated_queries" not in out
    assert "\n  biased_scores\n" in out.split("walk: token 3")[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "--window", "3"], "--window: expected only with --kind gqa, got --kind self"),
        (["trace", "--kind", "causal", "--alibi"], "--alibi: expected only with --kind gqa"),
        (["trace", "--kind", "gqa", "--kv-heads", "3"], "num_kv_heads: expected a divisor"),
        (["trace", "--kind", "gqa", "--d-out", "2", "--heads", "2"], "at least 2 features"),
        (
            ["plot", "--kind", "gqa", "--stage", "biased_scores", "-o", "x.png"],
            "biased_scores only with --alibi",
        ),
        (
            ["plot", "--kind", "self", "--stage", "biased_scores", "-o", "x.png"],
            "biased_scores needs --kind gqa --alibi",
        ),
        (
            ["plot", "--kind", "multihead", "--stage", "masked_scores", "-o", "x.png"],
            "masked_scores needs --kind causal, causal-multihead or gqa",
        ),
    ],
)
def test_gqa_options_are_refused_where_they_make_no_sense(capsys, tmp_path, argv, message):
    argv = [str(tmp_path / a) if a.endswith(".png") else a for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_plot_gqa_heatmaps_and_pipeline(capsys, tmp_path):
    for argv in (
        ["--alibi", "--stage", "biased_scores"],
        ["--window", "3", "--stage", "masked_scores"],
        ["--pipeline"],
    ):
        target = tmp_path / f"{len(list(tmp_path.iterdir()))}.png"
        code, _, err = run_cli(capsys, "plot", "--kind", "gqa", *argv, "-o", str(target))
        assert code == 0, err
        assert target.read_bytes().startswith(b"\x89PNG")


# --- check ---------------------------------------------------------------------------------------


def _fake_report(ok: bool) -> CheckReport:
    checks = [StageCheck(Stage.QUERIES, True, "matches", (2, 7, 4), (2, 7, 4))]
    failure = None
    if not ok:
        checks.append(StageCheck(Stage.SCALED_SCORES, False, "no scaling", (2, 7, 7), (2, 7, 7)))
        failure = Failure(Stage.SCALED_SCORES, "missing_scale", "not scaled", "mine.py:9")
    return CheckReport(ok, "self", "mine.py:Attn", failure, checks, kind_reason="one head")


@pytest.mark.parametrize("ok", [True, False])
def test_check_prints_the_report_and_exits_0_or_1(capsys, monkeypatch, ok):
    seen = {}

    def fake_check(target, **kwargs):
        seen.update(kwargs, target=target)
        return _fake_report(ok)

    monkeypatch.setattr("attnscope.checking.check", fake_check)
    code, out, _ = run_cli(
        capsys,
        "check",
        "mine.py:Attn",
        "--kind",
        "self",
        "--init",
        '{"d_in": 3, "d_out": 2}',
        "--seed",
        "5",
        "--timeout",
        "2.5",
        "--weights",
        "query=W_q, key=W_k",
    )
    assert code == (0 if ok else 1)
    assert seen == {
        "target": "mine.py:Attn",
        "kind": "self",
        "init": {"d_in": 3, "d_out": 2},
        "seed": 5,
        "timeout": 2.5,
        "weights": {"query": "W_q", "key": "W_k"},
        "tokens": None,
        "decode": None,
    }
    assert "mine.py:Attn" in out
    assert ("missing_scale" in out) is (not ok)


def test_check_json_is_the_reports_json(capsys, monkeypatch):
    monkeypatch.setattr("attnscope.checking.check", lambda target, **k: _fake_report(False))
    code, out, _ = run_cli(capsys, "check", "mine.py:Attn", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False and data["first_failure"]["mistake"] == "missing_scale"


def test_check_html_honours_force(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("attnscope.checking.check", lambda target, **k: _fake_report(True))
    target = tmp_path / "check.html"
    code, _, err = run_cli(capsys, "check", "mine.py:Attn", "--html", str(target))
    assert code == 0, err
    first = target.read_text(encoding="utf-8")
    assert "mine.py:Attn" in first
    target.write_text("mine")
    code, _, err = run_cli(capsys, "check", "mine.py:Attn", "--html", str(target), "--force")
    assert code == 0, err
    assert target.read_text(encoding="utf-8") != "mine"


def test_check_runs_the_real_checker_on_the_books_causal_attention(capsys):
    path = REPO / "examples" / "gallery" / "correct" / "causal_book.py"
    assert path.exists(), "the gallery's causal_book.py is part of the repository"
    assert "class CausalAttention" in path.read_text()
    code, out, err = run_cli(capsys, "check", f"{path}:CausalAttention")
    assert code == 0, out + err
    assert "masked_scores" in out


# --- the entry point -----------------------------------------------------------------------------


def test_help_and_version_exit_0(capsys):
    assert main(["--version"]) == 0
    assert attnscope.__version__ in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "--kind" in capsys.readouterr().out


def test_python_dash_m_attnscope_runs_the_demo():
    proc = subprocess.run(
        [sys.executable, "-m", "attnscope", "demo", "--kind", "simplified"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"NO_COLOR": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "0.4419  0.6515  0.5683" in proc.stdout and "\x1b[" not in proc.stdout
