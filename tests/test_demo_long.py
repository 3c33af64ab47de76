"""The demo on long inputs: above ``LONG_TOKENS`` every part walks row traces.

Small sizes stand in for long ones: the threshold is lowered to 16 tokens and the inputs
have 48, so that a tokens x tokens matrix (2,304 entries) is larger than any per-token
tensor the demo builds (at most 16 features per token).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnscope
import attnscope.functional.blocked as blocked
from attnscope.cli import main
from attnscope.demo import DEMO_KINDS, run_demo
from attnscope.demo import checks as demo_checks
from attnscope.demo.checks import rows_are_distributions
from attnscope.grouped import GroupedQueryAttention
from attnscope.render.text import demo_text

TOKENS = 48


def _x(tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(tokens, 3, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def long(monkeypatch):
    """Inputs of more than 16 tokens count as long; row traces take blocks of 8."""
    monkeypatch.setattr(demo_checks, "LONG_TOKENS", 16)
    monkeypatch.setattr(demo_checks, "LONG_BLOCK", 8)


def _verdicts(result) -> dict[str, bool]:
    return {c.name: c.ok for c in result.checks}


def _failed(result) -> set[str]:
    return {c.name for c in result.failures}


# --- the same walk, on rows ----------------------------------------------------------------------


def test_short_inputs_keep_full_traces():
    result = run_demo("all", x=_x())
    assert all(tr.rows is None for tr in result.traces.values())


@pytest.mark.parametrize("token", [1, TOKENS - 1])
def test_every_part_on_rows_passes_with_the_verdicts_of_full_traces(monkeypatch, token):
    x = _x()
    full = run_demo("all", x=x, token=token)
    monkeypatch.setattr(demo_checks, "LONG_TOKENS", 16)
    monkeypatch.setattr(demo_checks, "LONG_BLOCK", 8)
    rows = run_demo("all", x=x, token=token)
    assert full.ok and rows.ok, rows.failures
    expected = (token,) if token == TOKENS - 1 else (token, TOKENS - 1)
    assert [tr.rows for tr in rows.traces.values()] == [expected] * len(DEMO_KINDS)
    # the same checks, in the same order; a few name the rows they compare
    assert len(full.checks) == len(rows.checks)
    renamed = 0
    for a, b in zip(full.checks, rows.checks, strict=True):
        assert a.ok == b.ok
        renamed += a.name != b.name
    assert renamed <= 2
    # every trace's context is whole, and its row of the walk the same as the full one's
    for part, tr in rows.traces.items():
        assert tr["context"].shape == full.traces[part]["context"].shape
        torch.testing.assert_close(tr["context"], full.traces[part]["context"])


def test_long_steps_say_what_they_show_instead_of_the_matrix(long):
    result = run_demo("all", x=_x())
    text = demo_text(result, color=False)
    assert "computed without the matrix" in text
    assert f"only the rows of queries 1 ('1') and {TOKENS - 1}" in text
    step = next(s for s in result.steps if s.title.startswith("Every query at once"))
    weights = next(s for s in step.shown if s.name == "weights")
    assert weights.tensor.shape == (2, TOKENS) and weights.rows == ("1", str(TOKENS - 1))


def test_no_tokens_x_tokens_tensor_is_built(long):
    """Every operation's result stays under T * T entries (a matrix of one head)."""
    seen: list[tuple[str, int]] = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    seen.append((str(func), t.numel()))
            return out

    x = _x()
    with Sizes():
        result = run_demo("all", x=x)
    assert result.ok, result.failures
    assert seen
    big = [(name, n) for name, n in seen if n >= TOKENS * TOKENS]
    assert not big, big[:5]


def test_full_traces_do_build_the_matrix():
    """The spy above would see it: a short input's traces hold (T, T) stages."""
    result = run_demo("simplified", x=_x())
    assert result.traces["simplified"]["weights"].shape == (TOKENS, TOKENS)


def test_cli_demo_of_a_long_input(long, tmp_path, capsys):
    path = tmp_path / "long.npy"
    np.save(path, _x().numpy())
    html = tmp_path / "demo.html"
    code = main(["demo", "--kind", "gqa", "--input", str(path), "--html", str(html)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "checks passed" in out and "computed without the matrix" in out
    assert f"({TOKENS} tokens)" in out.splitlines()[1]
    page = html.read_text()
    assert "Every query, summarised" in page


def test_a_long_shown_tensor_prints_in_a_few_lines(monkeypatch):
    monkeypatch.setattr(demo_checks, "LONG_TOKENS", 1024)
    x = torch.randn(1500, 3, generator=torch.Generator().manual_seed(1))
    result = run_demo("causal", x=x)
    assert result.ok, result.failures
    text = demo_text(result, color=False)
    assert "too large to print" in text
    assert max(len(line) for line in text.splitlines()) < 400
    assert "1, 1499" in text or "rows: 1, 1499" in text


# --- and the checks still fail when they should ---------------------------------------------------


def test_a_rotation_that_starts_at_position_1_is_caught_on_rows(long, monkeypatch):
    def shifted(self, tokens, offset, device):
        return attnscope.functional.rope_angles(tokens, self.inv_freq, offset + 1).to(device)

    monkeypatch.setattr(GroupedQueryAttention, "_angles", shifted)
    failed = _failed(run_demo("rope", x=_x()))
    assert "position 0 is not turned: the identity" in failed
    assert "rotated_queries and rotated_keys are apply_rope(queries / keys, angles)" in failed
    assert "every pair keeps its length: a rotation" not in failed


def test_absolute_positions_are_caught_on_rows(long, monkeypatch):
    def squared(self, tokens, offset, device):
        positions = torch.arange(offset, offset + tokens, dtype=torch.float64) ** 2
        return attnscope.functional.rope_angles(tokens, self.inv_freq, positions=positions).to(
            device
        )

    monkeypatch.setattr(GroupedQueryAttention, "_angles", squared)
    failed = _failed(run_demo("rope", x=_x()))
    assert "every position shifted by 100: the output does not change" in failed


def test_a_mask_that_hides_too_little_is_caught_on_rows(long, monkeypatch):
    """The row core's mask one key wider (the future's first key, and one more key of the
    window): the checks built from positions catch it."""
    real = blocked._hidden

    def leaky(qpos, kpos, causal, window):
        return real(qpos + 1, kpos, causal, None if window is None else window + 2)

    monkeypatch.setattr(blocked, "_hidden", leaky)
    failed = _failed(run_demo("all", x=_x()))
    for name in [
        "the masked scores are -inf exactly above the diagonal",
        "the first token attends to itself alone (weight 1 on key 0)",  # not a traced row
        "changing the tokens after 1 leaves output rows 0..1 unchanged",
        "query i sees min(i + 1, 3) keys, in every head",
        "the visible keys of query i are i - 2 .. i",
        f"changing token 0 leaves rows 3, {TOKENS - 1} of the output unchanged (outside "
        "their window)",
        "the fast path equals the explicit stages (window=3)",
    ]:
        assert name in failed, name


def test_alibi_with_the_wrong_sign_is_caught_on_rows(long, monkeypatch):
    real = blocked._bias_block
    monkeypatch.setattr(blocked, "_bias_block", lambda *args: -real(*args))
    failed = _failed(run_demo("gqa", x=_x()))
    assert "biased_scores - scaled_scores is -slope * |query - key|" in failed
    assert "in every row the bias rises toward the query: near keys are favoured" in failed
    assert "the fast path equals the explicit stages (ALiBi, 8 heads)" in failed


def test_a_silenced_kv_head_that_changes_the_wrong_group_is_caught_on_rows(long, monkeypatch):
    """Grouped kv heads read with repeat (h % K) instead of repeat_interleave in the rows
    the checks compare."""
    real = blocked.attend_rows

    def tiled(queries, keys, rows, **kw):
        if keys.dim() == 4 and queries.dim() == 4 and keys.shape[1] != queries.shape[1]:
            keys = keys.repeat(1, queries.shape[1] // keys.shape[1], 1, 1)
        return real(queries, keys, rows, **kw)

    monkeypatch.setattr(blocked, "attend_rows", tiled)
    monkeypatch.setattr(attnscope.functional, "attend_rows", tiled)
    failed = _failed(run_demo("gqa", x=_x()))
    assert any(name.startswith("the single-token context vector") for name in failed), failed


def test_weights_rows_that_do_not_sum_to_1_are_caught_on_rows(long):
    result = run_demo("causal", x=_x())
    tr = result.traces["causal"]
    assert tr.rows == (1, TOKENS - 1)
    w, logits = tr["weights"], tr["masked_scores"]
    assert rows_are_distributions(w, logits, causal=True, rows=tr.rows).ok
    assert not rows_are_distributions(1.01 * w, logits, causal=True, rows=tr.rows).ok
    peeking = w.clone()
    peeking[0, 5] = 1e-3  # row of query 1: key 5 is in its future
    peeking[0] /= peeking[0].sum()
    check = rows_are_distributions(peeking, logits, causal=True, rows=tr.rows)
    assert not check.ok and "above the diagonal" in check.name
    # the same weights read as rows 0 and 1 of a full trace are wrong the other way round
    assert not rows_are_distributions(w, logits, causal=True, rows=[0, 1]).ok


def test_the_walk_of_a_query_far_from_the_start_allows_for_alibis_large_bias():
    """ALiBi adds -slope * distance: at 1,500 tokens a logit near -750, whose float32
    rounding (a unit in the last place is 6e-5) the walk must allow for."""
    x = torch.randn(1500, 3, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng():
        torch.manual_seed(123)
        layer = GroupedQueryAttention(3, 16, 8, 2, alibi=True).eval()
    tr = layer.trace(x, rows=[1499], summary=False)
    walk = tr.walk(1499)
    assert walk.scores_match and walk.matches


def test_long_tensors_name_their_rows_and_columns_in_short_lists(long):
    words = ("Your", "journey", "starts", "with", "one", "step")
    tokens = 102  # (2, 102) weights: too many values to print
    labels = [words[i % 6] for i in range(tokens)]
    text = demo_text(run_demo("self", x=_x(tokens), labels=labels), color=False)
    line = next(s for s in text.splitlines() if s.strip().startswith(f"weights  (2, {tokens})"))
    assert line.endswith(
        f"rows journey (1), step ({tokens - 1}); columns Your, journey, starts, with, …, one, "
        f"step ({tokens} tokens)"
    )
    # positions 0, 1, 2, ... go without saying; heads are counted as heads
    plain = demo_text(run_demo("gqa", x=_x(tokens)), color=False)
    assert "columns 0, 1, 2" not in plain and "rows 0, 1, 2" not in plain
    alibi = next(s for s in plain.splitlines() if "bias of token 1" in s)
    assert alibi.endswith("rows head 0, head 1, head 2, head 3, …, head 6, head 7 (8 heads)")


def test_the_threshold_and_the_rows_chosen():
    assert demo_checks.LONG_TOKENS == 1024
    assert demo_checks.demo_rows(1023, 1) is None
    assert demo_checks.demo_rows(1024, 1) == (1, 1023)
    assert demo_checks.demo_rows(1024, 1023) == (1023,)
