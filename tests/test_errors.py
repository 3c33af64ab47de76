"""Every error path: one AttnScopeError that says what was expected and what was given,
and on the command line one ``attnscope: error:`` line, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import attnscope
from attnscope import CausalAttention, MultiHeadAttention, SelfAttentionV1, SelfAttentionV2
from attnscope.cli import main
from attnscope.errors import AttnScopeError
from attnscope.render import write_output
from attnscope.stages import stages_for_kind

BOOK = attnscope.book_embeddings()


# --- library -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.ones(3), r"expected shape \(tokens, d_in\) or \(batch, tokens, d_in\)"),
        (torch.ones(1, 1, 6, 3), r"got tensor of shape \(1, 1, 6, 3\)"),
        (torch.ones(6, 4), r"expected 3 features .*d_in=3.*\(6, 4\)"),
        (torch.ones(0, 3), "at least one token"),
        (torch.ones(6, 3, dtype=torch.int64), "floating-point.*int64"),
        (torch.ones(6, 3, dtype=torch.bool), "floating-point.*bool"),
        (torch.tensor([[1.0, float("nan"), 0.0]]), "1 NaN or inf"),
        (torch.tensor([[1.0, float("inf"), 0.0]]), "1 NaN or inf"),
        (torch.ones(6, 3, dtype=torch.float64), "float32 to match the module's weights"),
        ([[0.1, 0.2, 0.3]], "expected a torch.Tensor, got list"),
    ],
)
@pytest.mark.parametrize("make", [lambda: SelfAttentionV1(3, 2), lambda: SelfAttentionV2(3, 2)])
def test_bad_module_inputs_are_one_clear_error(make, x, message):
    module = make()
    with pytest.raises(AttnScopeError, match=message):
        module(x)
    with pytest.raises(AttnScopeError, match=message):
        module.trace(x)


def test_more_tokens_than_context_length_is_rejected():
    with pytest.raises(AttnScopeError, match="at most context_length=4 tokens, got 6"):
        CausalAttention(3, 2, context_length=4, dropout=0.0)(BOOK)
    with pytest.raises(AttnScopeError, match="context_length=4"):
        MultiHeadAttention(3, 2, 4, 0.0, num_heads=2)(BOOK)


def test_d_out_not_divisible_by_num_heads_is_rejected():
    with pytest.raises(AttnScopeError, match=r"divisor of d_out=6, got num_heads=4"):
        MultiHeadAttention(3, 6, 8, 0.0, num_heads=4)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SelfAttentionV1(0, 2), "d_in: expected a positive integer"),
        (lambda: SelfAttentionV2(3, 2.5), "d_out: expected a positive integer"),
        (
            lambda: CausalAttention(3, 2, 6, dropout=1.0),
            r"dropout: expected a probability in \[0, 1\)",
        ),
        (lambda: MultiHeadAttention(3, 2, 6, 0.0, num_heads=0), "num_heads: expected a positive"),
        (lambda: CausalAttention(3, 2, True, 0.0), "context_length: expected a positive integer"),
    ],
)
def test_bad_constructor_arguments_are_rejected(build, message):
    with pytest.raises(AttnScopeError, match=message):
        build()


def test_v1_from_a_v2_with_biases_is_rejected():
    with pytest.raises(AttnScopeError, match="qkv_bias=False"):
        SelfAttentionV1.from_v2(SelfAttentionV2(3, 2, qkv_bias=True))


@pytest.mark.parametrize("token", [6, -7, 1.0, True, "1"])
def test_out_of_range_or_non_integer_query_token_is_rejected(token):
    tr = SelfAttentionV1(3, 2).trace(BOOK)
    with pytest.raises(AttnScopeError, match="query token"):
        tr.walk(token)


def test_bad_labels_and_targets_for_a_trace_are_rejected():
    with pytest.raises(AttnScopeError, match="expected 6 labels"):
        attnscope.trace("simplified", BOOK, labels=["a", "b"])
    with pytest.raises(AttnScopeError, match="'simplified'"):
        attnscope.trace("causal", BOOK)
    with pytest.raises(AttnScopeError, match="attnscope.check"):
        attnscope.trace(torch.nn.Linear(3, 2), BOOK)


def test_unknown_kind_and_stage_are_rejected():
    with pytest.raises(AttnScopeError, match="kind: expected one of"):
        stages_for_kind("sparse")
    with pytest.raises(AttnScopeError, match="masked_scores"):
        attnscope.trace("simplified", BOOK)["masked_scores"]


def test_functional_shape_mismatches_name_both_shapes():
    with pytest.raises(AttnScopeError, match=r"query: expected 3 features .*\(6, 3\)"):
        attnscope.functional.query_scores(BOOK, torch.ones(4))
    with pytest.raises(AttnScopeError, match=r"values: expected 6 rows"):
        attnscope.functional.context_vectors(torch.ones(6, 6), torch.ones(5, 2))
    with pytest.raises(AttnScopeError, match="divisor of d_out=6"):
        attnscope.functional.split_heads(torch.ones(1, 2, 6), 4)


def test_existing_output_file_is_not_overwritten_without_asking(tmp_path):
    path = tmp_path / "report.html"
    path.write_text("mine")
    with pytest.raises(AttnScopeError, match="--force"):
        write_output(path, "new")
    assert path.read_text() == "mine"
    write_output(path, "new", overwrite=True)
    assert path.read_text() == "new"


# --- command line ------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.startswith("attnscope: error: "), err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def npy(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, BOOK.numpy())
    return path


@pytest.mark.parametrize("command", ["demo", "trace"])
def test_cli_missing_embeddings_file(capsys, tmp_path, command):
    code, out, err = run_cli(capsys, command, "--input", str(tmp_path / "missing.npy"))
    assert_user_error(code, err, "missing.npy", "no such file")
    assert out == ""


def test_cli_malformed_embeddings_file(capsys, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("1,2,3\n4,five,6\n")
    code, _, err = run_cli(capsys, "trace", "--input", str(path))
    assert_user_error(code, err, "bad.csv, line 2, column 2", "'five'")


def test_cli_nan_in_embeddings_file(capsys, tmp_path):
    path = tmp_path / "nan.npy"
    np.save(path, np.array([[1.0, np.nan]]))
    code, _, err = run_cli(capsys, "demo", "--input", str(path))
    assert_user_error(code, err, "NaN or inf")


@pytest.mark.parametrize("command", ["demo", "trace"])
def test_cli_out_of_range_query_token(capsys, command):
    code, out, err = run_cli(capsys, command, "--token", "6")
    assert_user_error(code, err, "--token", "from 0 to 5", "got 6")
    assert out == ""


def test_cli_bad_labels(capsys, npy, tmp_path):
    code, _, err = run_cli(capsys, "trace", "--input", str(npy), "--labels", "a,b")
    assert_user_error(code, err, "expected 6 labels", "got 2")
    code, _, err = run_cli(capsys, "demo", "--labels", "a,,c,d,e,f")
    assert_user_error(code, err, "non-empty label")
    code, _, err = run_cli(capsys, "demo", "--labels-file", str(tmp_path / "none.txt"))
    assert_user_error(code, err, "none.txt")


def test_cli_d_out_not_divisible_by_heads(capsys):
    code, _, err = run_cli(capsys, "trace", "--kind", "multihead", "--d-out", "6", "--heads", "4")
    assert_user_error(code, err, "divisor of d_out=6")


def test_cli_demo_refuses_a_batch(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save(torch.stack((BOOK, BOOK)), path)
    code, _, err = run_cli(capsys, "demo", "--input", str(path))
    assert_user_error(code, err, "(tokens, d_in)", "attnscope trace")


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--kind", "cross"],
        ["demo", "--bogus"],
        ["trace", "--d-out", "0"],
        ["trace", "--seed", "abc"],
        ["plot", "--highlight", "1", "-o", "x.png"],
        ["plot"],  # -o is required
        ["check"],  # TARGET is required
        ["check", "t.py:A", "--timeout", "-1"],
        ["demo", "--labels", "a", "--labels-file", "f"],
    ],
)
def test_cli_usage_errors_are_one_line_and_exit_2(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert_user_error(code, err)
    assert "--help" in err
    assert out == ""


def test_plain_attnscope_prints_what_it_can_do(capsys):
    code, out, err = run_cli(capsys)
    assert code == 0 and err == ""
    assert "demo" in out and "check" in out and "usage: attnscope" in out


def test_cli_existing_output_is_refused_before_computing(capsys, tmp_path, monkeypatch):
    existing = tmp_path / "out.html"
    existing.write_text("mine")

    def must_not_run(*args, **kwargs):
        raise AssertionError("computed before checking the output file")

    monkeypatch.setattr("attnscope.demo.run_demo", must_not_run)
    monkeypatch.setattr("attnscope.demo.make_trace", must_not_run)
    monkeypatch.setattr("attnscope.checking.check", must_not_run)
    for argv in (
        ["demo", "--html", str(existing)],
        ["trace", "--html", str(existing)],
        ["plot", "-o", str(existing)],
        ["check", "x.py:A", "--html", str(existing)],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert_user_error(code, err, "out.html", "--force")
    assert existing.read_text() == "mine"


def test_cli_output_in_a_missing_folder_or_onto_the_input_is_refused(capsys, tmp_path, npy):
    code, _, err = run_cli(capsys, "plot", "-o", str(tmp_path / "no" / "such" / "f.png"))
    assert_user_error(code, err, "existing folder")
    code, _, err = run_cli(capsys, "plot", "--input", str(npy), "-o", str(npy), "--force")
    assert_user_error(code, err, "the input file itself")
    assert np.load(npy).shape == (6, 3)


def test_cli_plot_bad_stage_suffix_and_highlight(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "plot", "--stage", "masked_scores", "-o", str(tmp_path / "a.png")
    )
    assert_user_error(code, err, "no masked_scores", "--kind causal")
    code, _, err = run_cli(capsys, "plot", "-o", str(tmp_path / "a.jpg"))
    assert_user_error(code, err, ".png, .svg", "'.jpg'")
    code, _, err = run_cli(
        capsys, "plot", "--pipeline", "--stage", "scores", "-o", str(tmp_path / "a.png")
    )
    assert_user_error(code, err, "--pipeline")
    pytest.importorskip("matplotlib")
    code, _, err = run_cli(capsys, "plot", "--highlight", "1,9", "-o", str(tmp_path / "a.png"))
    assert_user_error(code, err, "--highlight", "from 0 to 5", "1,9")
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--init", "[1, 2]"], "--init: expected a JSON object"),
        (["--init", "{d_in: 3}"], "invalid JSON"),
        (["--weights", "query"], "ROLE=NAME"),
        (["--weights", "query=W_q,bias=b"], "'bias'"),
        (["--weights", "query=a,query=b"], "given twice"),
    ],
)
def test_cli_check_bad_init_and_weights(capsys, monkeypatch, argv, fragment):
    monkeypatch.setattr("attnscope.checking.check", lambda *a, **k: pytest.fail("ran"))
    code, _, err = run_cli(capsys, "check", "mine.py:Attn", *argv)
    assert_user_error(code, err, fragment)


def test_cli_check_errors_from_the_checker_exit_2(capsys, monkeypatch):
    def fails(*args, **kwargs):
        raise AttnScopeError("target: expected path/to/file.py:NAME, got 'x'")

    monkeypatch.setattr("attnscope.checking.check", fails)
    code, _, err = run_cli(capsys, "check", "x")
    assert_user_error(code, err, "path/to/file.py:NAME")


def test_entry_point_reports_user_errors_without_a_traceback(tmp_path):
    """Through the real interpreter: python -m attnscope."""
    proc = subprocess.run(
        [sys.executable, "-m", "attnscope", "demo", "--input", str(tmp_path / "gone.csv")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("attnscope: error: ") and "gone.csv" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_finite_check_accepts_huge_finite_values_and_catches_nan_among_them():
    """The fast finite check sums first; an overflowing sum must not reject finite input."""
    from attnscope.errors import check_embeddings

    huge = torch.full((2, 3), 3e38)
    assert check_embeddings(huge) is huge
    huge[1, 2] = float("nan")
    with pytest.raises(AttnScopeError, match="1 NaN or inf"):
        check_embeddings(huge)
    opposite = torch.tensor([[float("inf"), -float("inf")]])  # sums to NaN, not inf
    with pytest.raises(AttnScopeError, match="2 NaN or inf"):
        check_embeddings(opposite)


# --- functional: one error naming what was expected and given, never a torch traceback -----------

AF = attnscope.functional


@pytest.mark.parametrize("fn", [AF.softmax, AF.normalize_sum, AF.softmax_naive])
@pytest.mark.parametrize("dim", [2, -3, 1.0, True])
def test_normalising_along_an_axis_the_scores_lack_is_rejected(fn, dim):
    with pytest.raises(AttnScopeError, match=r"dim: expected an axis from -2 to 1 .*\(6, 6\)"):
        fn(torch.rand(6, 6), dim=dim)


def test_a_mask_smaller_than_the_scores_is_rejected():
    with pytest.raises(AttnScopeError, match=r"mask: expected at least \(6, 6\) .*\(4, 4\)"):
        AF.apply_causal_mask(torch.rand(6, 6), AF.causal_mask(4))
    with pytest.raises(AttnScopeError, match="mask: expected a .*got list"):
        AF.apply_causal_mask(torch.rand(6, 6), [[True]])
    bigger = AF.apply_causal_mask(torch.rand(2, 6, 6), AF.causal_mask(9))  # cropped: fine
    assert torch.isneginf(bigger[0, 0, 1:]).all()


def test_context_vectors_with_mismatched_batch_dimensions_is_rejected():
    message = r"values: expected leading .*\(2, 6, 6\).*\(3, 6, 2\)"
    with pytest.raises(AttnScopeError, match=message):
        AF.context_vectors(torch.rand(2, 6, 6), torch.rand(3, 6, 2))
    assert AF.context_vectors(torch.rand(2, 6, 6), torch.rand(6, 2)).shape == (2, 6, 2)


@pytest.mark.parametrize(
    ("q", "k", "v", "kwargs", "message"),
    [
        ("q", torch.rand(6, 2), torch.rand(6, 2), {}, "queries: expected a torch.Tensor, got str"),
        (torch.rand(2), torch.rand(6, 2), torch.rand(6, 2), {}, r"queries: expected shape"),
        (torch.ones(6, 2, dtype=torch.long), torch.rand(6, 2), torch.rand(6, 2), {}, "int64"),
        (torch.rand(6, 2), torch.rand(6, 2).double(), torch.rand(6, 2), {}, "dtype of queries"),
        (torch.rand(6, 2), torch.rand(6, 3), torch.rand(6, 2), {}, r"keys: expected .*\(6, 3\)"),
        (torch.rand(2, 6, 2), torch.rand(3, 6, 2), torch.rand(3, 6, 2), {}, "keys: expected"),
        (torch.rand(6, 2), torch.rand(6, 2), torch.rand(5, 2), {}, r"values: .*\(5, 2\)"),
        (torch.rand(4, 2), torch.rand(6, 2), torch.rand(6, 2), {"causal": True}, "causal"),
        (
            torch.rand(6, 2),
            torch.rand(6, 2),
            torch.rand(6, 2),
            {"causal": True, "mask": AF.causal_mask(4)},
            r"mask: expected at least \(6, 6\)",
        ),
    ],
)
def test_attend_rejects_bad_inputs_with_one_clear_error(q, k, v, kwargs, message):
    with pytest.raises(AttnScopeError, match=message):
        AF.attend(q, k, v, **kwargs)


def test_predicted_shape_of_an_unknown_stage_is_rejected():
    tr = SelfAttentionV1(3, 2).trace(BOOK)
    with pytest.raises(AttnScopeError, match="stage: expected one of query, queries, .*'foo'"):
        tr.predicted_shape("foo")


def test_a_bad_batch_index_counts_sequences_not_tokens():
    tr = SelfAttentionV1(3, 2).trace(torch.stack((BOOK, BOOK)))
    with pytest.raises(AttnScopeError, match=r"batch index: .*from 0 to 1 .*2 sequences\), got 2"):
        tr.walk(1, batch=2)


def test_demo_seeds_and_labels_are_checked():
    from attnscope.demo import make_trace, run_demo

    with pytest.raises(AttnScopeError, match=r"seed: expected an integer from -2\*\*63"):
        run_demo("self", seed=2**64)
    with pytest.raises(AttnScopeError, match="seed: "):
        make_trace("self", BOOK, seed=-(2**63) - 1)
    with pytest.raises(AttnScopeError, match="labels: expected 6 labels"):
        run_demo("simplified", labels=[1, 2])


# --- command line: seeds, negative tokens, folders ------------------------------------------------


@pytest.mark.parametrize("command", [["demo"], ["trace"], ["plot", "-o", "x.png"], ["check", "a"]])
def test_cli_seed_beyond_torchs_range_is_a_usage_error(capsys, command):
    code, out, err = run_cli(capsys, *command, "--seed", "99999999999999999999999")
    assert_user_error(code, err, "--seed", "2**64 - 1", "99999999999999999999999")
    assert out == ""


@pytest.mark.parametrize("command", ["demo", "trace"])
def test_cli_negative_token_is_rejected(capsys, command):
    """The library counts negative positions from the end; --token counts from 0 only, and
    its messages say so."""
    code, out, err = run_cli(capsys, command, "--token", "-1")
    assert_user_error(code, err, "--token", ">= 0", "-1")
    assert out == ""
    code, _, err = run_cli(capsys, command, "--token", "6")
    assert_user_error(code, err, "from 0 to 5 (the input has 6 tokens), got 6")


def test_library_token_messages_mention_counting_from_the_end():
    tr = SelfAttentionV1(3, 2).trace(BOOK)
    assert tr.walk(-1).token == 5
    with pytest.raises(AttnScopeError, match=r"from 0 to 5 \(or -6 to -1 counting from the end"):
        tr.walk(-7)


def test_cli_labels_file_that_is_a_folder_says_so(capsys, tmp_path):
    code, _, err = run_cli(capsys, "demo", "--labels-file", str(tmp_path))
    assert_user_error(code, err, "a folder")
    assert "no such file" not in err
