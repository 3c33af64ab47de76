"""The demo's modern parts, rope and gqa: predict, then check, and every check can fail.

Each failing case plants one bug in the library (a rotation that is not one, the wrong kv
head mapping, a window off by one, ALiBi's bias with the wrong sign, ...) and names the
checks that must catch it; the real library passes them all.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnscope as a
import attnscope.functional as AF
from attnscope.demo import DEMO_KINDS, run_demo
from attnscope.demo import gqa as gqa_part
from attnscope.demo import rope as rope_part
from attnscope.demo.checks import rows_are_distributions
from attnscope.functional import core
from attnscope.grouped import GroupedQueryAttention
from attnscope.render.text import demo_text

ROPE_CHECKS = [
    "rotated_queries and rotated_keys are apply_rope(queries / keys, angles)",
    "every pair keeps its length: a rotation",
    "position 0 is not turned: the identity",
    "scores are rotated_queries @ rotated_keys.T",
    "they are not the unrotated queries @ keys.T",
    "every position shifted by 100: the output does not change",
    "shifting both positions by the same amount keeps the score",
    "shifting only one of them changes it",
    "half keeps the length of every pair (i, i + D/2)",
    "interleaved keeps the length of every pair (2i, 2i + 1)",
    "interleaved is Meta's complex-number rotation",
    "the two pairings give other numbers",
    "mixing one layout's tables with the other's rotation changes lengths: not a rotation",
    "... and with them a score depends on more than the distance",
    "features 4..7 of every head pass through untouched",
    "features 0..3 do turn",
]

GQA_CHECKS = [
    "zeroing kv head 0's values changes exactly the context of query heads 0, 1",
    "zeroing kv head 1's values changes exactly the context of query heads 2, 3",
    "num_kv_heads=1 equals multi-head attention with each kv head copied to its group",
    "num_kv_heads=2 equals multi-head attention with each kv head copied to its group",
    "query i sees min(i + 1, 3) keys, in every head",
    "the visible keys of query i are i - 2 .. i",
    "the weights outside the window are exactly 0",
    "changing token 0 leaves rows 3.. of the output unchanged (outside their window)",
    "the slopes of 8 heads are ALiBi's published 1/2, 1/4, ..., 1/256",
    "they are a geometric sequence: each is the one before times 2**(-8/8)",
    "biased_scores - scaled_scores is -slope * |query - key|",
    "in every row the bias rises toward the query: near keys are favoured",
    "the fast path equals the explicit stages (4 heads, 2 kv heads)",
    "the fast path equals the explicit stages (window=3)",
    "the fast path equals the explicit stages (ALiBi, 8 heads)",
]


def _names(result) -> dict[str, bool]:
    return {c.name: c.ok for c in result.checks}


def _failed(result) -> set[str]:
    return {c.name for c in result.failures}


def _skipped(result) -> list[str]:
    return [c.name for c in result.checks if c.detail.startswith("skipped")]


# --- the real library passes -------------------------------------------------------------------


def test_modern_parts_come_after_the_books_in_all():
    assert DEMO_KINDS[-2:] == ("rope", "gqa")
    result = run_demo("all")
    parts = list(dict.fromkeys(step.part for step in result.steps))
    assert parts == list(DEMO_KINDS) and result.ok


@pytest.mark.parametrize(("kind", "names"), [("rope", ROPE_CHECKS), ("gqa", GQA_CHECKS)])
def test_every_check_runs_and_passes_on_the_books_tokens(kind, names):
    result = run_demo(kind)
    assert result.ok, result.failures
    got = _names(result)
    for name in names:
        assert got.get(name) is True, name
    assert not _skipped(result)
    # every step predicts before it shows, and checks something
    for step in result.steps:
        assert "Predict:" in step.predict and (step.checks or step.shapes), step.title


def test_rope_shows_the_rotated_stages_of_a_grouped_layer():
    result = run_demo("rope")
    tr = result.traces["rope"]
    assert isinstance(tr.module, GroupedQueryAttention)
    assert {"rotated_queries", "rotated_keys"} <= set(tr.stages)
    first = result.steps[0]
    assert [s.name for s in first.shapes] == [
        "queries",
        "keys",
        "rotated_queries",
        "rotated_keys",
    ]
    shown = {s.name: s.tensor for s in first.shown}
    torch.testing.assert_close(shown["rotated_queries, head 0"], tr["rotated_queries"][0])
    # the angles table: position times frequency, row 0 all zero
    angles = shown["angles = position * frequency"]
    assert angles.shape == (6, 4) and (angles[0] == 0).all()
    torch.testing.assert_close(angles[3], 3 * tr.module.inv_freq.double())


def test_gqa_shapes_are_predicted_per_kind_of_head():
    result = run_demo("gqa")
    shapes = {s.name: (s.predicted, s.actual) for s in result.steps[0].shapes}
    assert shapes["queries"] == ((4, 6, 4), (4, 6, 4))
    assert shapes["keys"] == ((2, 6, 4), (2, 6, 4)) == shapes["values"]
    assert shapes["W_key.weight"] == ((8, 3), (8, 3))
    third = {s.name: s.actual for s in result.steps[2].shapes}
    assert third == {f"keys, num_kv_heads={k}": (k, 6, 4) for k in (1, 2, 4)}


def test_demo_text_titles_the_modern_parts():
    text = demo_text(run_demo("all"), color=False)
    assert text.index("== Causal multi-head") < text.index("== Rotary position embeddings")
    assert text.index("== Rotary") < text.index("== Grouped-query attention")
    assert "FAIL" not in text


@pytest.mark.parametrize("kind", ["rope", "gqa"])
def test_other_inputs_tokens_and_seeds(kind):
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(3))
    result = run_demo(kind, x=x, token=7, seed=11, labels=list("abcdefghi"))
    assert result.ok, result.failures
    assert result.main_trace.labels == tuple("abcdefghi")
    assert not _skipped(result)


@pytest.mark.parametrize("kind", ["rope", "gqa"])
def test_degenerate_inputs_skip_with_a_reason_instead_of_failing(kind):
    one = run_demo(kind, x=a.book_embeddings()[:1])
    zero = run_demo(kind, x=torch.zeros(4, 3))
    assert one.ok and zero.ok, (one.failures, zero.failures)
    assert _skipped(one) and _skipped(zero)


def test_large_embeddings_keep_the_modern_checks_honest():
    for kind in ("rope", "gqa"):
        result = run_demo(kind, x=a.book_embeddings() * 20)
        assert result.ok, result.failures


# --- and each check can fail -------------------------------------------------------------------


def test_a_rotation_that_starts_at_position_1_is_caught(monkeypatch):
    """The layer's angles off by one position: position 0 turns, and the trace's rotated
    stages are no longer apply_rope at positions 0.. ."""

    def shifted(self, tokens, offset, device):
        return AF.rope_angles(tokens, self.inv_freq, offset + 1).to(device)

    monkeypatch.setattr(GroupedQueryAttention, "_angles", shifted)
    failed = _failed(run_demo("rope"))
    assert "position 0 is not turned: the identity" in failed
    assert "rotated_queries and rotated_keys are apply_rope(queries / keys, angles)" in failed
    # still a rotation of the right kind: those checks hold
    assert "every pair keeps its length: a rotation" not in failed
    assert "shifting both positions by the same amount keeps the score" not in failed


def _tampered(monkeypatch, change) -> None:
    """Every GroupedQueryAttention the rope part builds returns traces with ``change``
    applied to their stages: a bug planted in what the layer computed, whatever the layer's
    internals."""

    class Tampered(GroupedQueryAttention):
        def trace(self, x, labels=None, context=None):
            tr = super().trace(x, labels=labels, context=context)
            return dataclasses.replace(tr, stages=change(dict(tr.stages)))

    monkeypatch.setattr(rope_part, "GroupedQueryAttention", Tampered)


def test_a_rotation_that_is_not_one_is_caught(monkeypatch):
    """The classic bug (half tables, interleaved rotation) in the layer's rotated stages."""

    def mixed(stages):
        for name in ("queries", "keys"):
            v = stages[name]
            angles = AF.rope_angles(v.shape[-2], AF.rope_frequencies(v.shape[-1]))
            mixed = rope_part._with_tables(v, angles, "half", "interleaved")
            stages[f"rotated_{name}"] = mixed.to(v.dtype)
        return stages

    _tampered(monkeypatch, mixed)
    failed = _failed(run_demo("rope"))
    assert "every pair keeps its length: a rotation" in failed
    assert "rotated_queries and rotated_keys are apply_rope(queries / keys, angles)" in failed
    assert "position 0 is not turned: the identity" not in failed  # angle 0 still is


def test_the_demos_own_rotations_can_fail(monkeypatch):
    """apply_rope replaced by the classic bug: every check the demo computes with it fails."""
    real = AF.apply_rope

    def mixed(x, angles, pairing="half"):
        if angles.shape[-1] * 2 != x.shape[-1]:
            return real(x, angles, pairing)
        return rope_part._with_tables(x, angles, "half", "interleaved").to(x.dtype)

    monkeypatch.setattr(AF, "apply_rope", mixed)
    failed = _failed(run_demo("rope"))
    for name in [
        "rotated_queries and rotated_keys are apply_rope(queries / keys, angles)",
        "shifting both positions by the same amount keeps the score",
        "half keeps the length of every pair (i, i + D/2)",
        "interleaved keeps the length of every pair (2i, 2i + 1)",
        "interleaved is Meta's complex-number rotation",
        "cat(angles, angles) tables with rotate_half are the half pairing",
    ]:
        assert name in failed, name


def test_absolute_positions_are_caught(monkeypatch):
    """Angles from position**2: still rotations, but scores no longer depend on distance."""

    def squared(self, tokens, offset, device):
        positions = torch.arange(offset, offset + tokens, dtype=torch.float64) ** 2
        return AF.rope_angles(tokens, self.inv_freq, positions=positions).to(device)

    monkeypatch.setattr(GroupedQueryAttention, "_angles", squared)
    failed = _failed(run_demo("rope"))
    assert "every position shifted by 100: the output does not change" in failed
    assert "rotated_queries and rotated_keys are apply_rope(queries / keys, angles)" in failed
    assert "every pair keeps its length: a rotation" not in failed


def test_one_pairing_for_both_is_caught(monkeypatch):
    real = AF.apply_rope
    monkeypatch.setattr(AF, "apply_rope", lambda x, angles, pairing="half": real(x, angles))
    failed = _failed(run_demo("rope"))
    assert "the two pairings give other numbers" in failed
    assert "interleaved is Meta's complex-number rotation" in failed


def test_no_rotation_at_all_is_caught(monkeypatch):
    def still(self, tokens, offset, device):
        return torch.zeros(tokens, self.inv_freq.shape[0], dtype=torch.float64, device=device)

    monkeypatch.setattr(GroupedQueryAttention, "_angles", still)
    failed = _failed(run_demo("rope"))
    assert "they are not the unrotated queries @ keys.T" in failed
    assert "features 0..3 do turn" in failed
    monkeypatch.undo()
    monkeypatch.setattr(AF, "apply_rope", lambda x, angles, pairing="half": x.clone())
    assert "shifting only one of them changes it" in _failed(run_demo("rope"))


def test_a_partial_rotation_that_touches_the_rest_is_caught(monkeypatch):
    def leaky(stages):
        for name in ("rotated_queries", "rotated_keys"):
            v = stages[name]
            stages[name] = torch.cat([v[..., :4], 1.01 * v[..., 4:]], dim=-1)
        return stages

    _tampered(monkeypatch, leaky)
    assert "features 4..7 of every head pass through untouched" in _failed(run_demo("rope"))


def test_mixed_tables_are_a_rotation_with_one_frequency():
    """With a single pair both layouts are the same table: the bug check then fails, as it
    must (it claims the lengths change)."""
    torch.manual_seed(0)
    layer = GroupedQueryAttention(3, 4, 2).eval()  # head_dim 2: one frequency
    tr = layer.trace(a.book_embeddings())
    checks = {c.name: c.ok for c in rope_part._mixed_tables(tr, layer).checks}
    assert checks == {
        "cat(angles, angles) tables with rotate_half are the half pairing": True,
        "repeat_interleave(angles, 2) tables with rotate_every_two are the interleaved pairing": (
            True
        ),
        "mixing one layout's tables with the other's rotation changes lengths: not a rotation": (
            False
        ),
        "... and with them a score depends on more than the distance": False,
    }


def test_pair_lengths_check_fails_on_a_scaling():
    q = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    assert rope_part._length_kept("x", q, q, "half", 8).ok
    assert not rope_part._length_kept("x", q, 1.001 * q, "half", 8).ok
    assert not rope_part._length_kept("x", q, q[..., [1, 0, 2, 3, 4, 5, 6, 7]], "half", 8).ok


def _repeat_not_interleave(monkeypatch):
    """The grouped-head bug: kv heads tiled with repeat (h % K) instead of repeat_interleave."""
    real = AF.attend

    def attend(queries, keys, values, **kw):
        if keys.dim() == 4 and keys.shape[1] != queries.shape[1]:
            group = queries.shape[1] // keys.shape[1]
            keys, values = keys.repeat(1, group, 1, 1), values.repeat(1, group, 1, 1)
        return real(queries, keys, values, **kw)

    monkeypatch.setattr(AF, "attend", attend)


def test_the_wrong_kv_head_mapping_is_caught(monkeypatch):
    _repeat_not_interleave(monkeypatch)
    result = run_demo("gqa")
    failed = _failed(result)
    for name in [
        "zeroing kv head 0's values changes exactly the context of query heads 0, 1",
        "zeroing kv head 1's values changes exactly the context of query heads 2, 3",
        "num_kv_heads=2 equals multi-head attention with each kv head copied to its group",
        "the fast path equals the explicit stages (4 heads, 2 kv heads)",
        "the single-token context vector equals its row of the batched output "
        "(4 heads, 2 kv heads)",
    ]:
        assert name in failed, name
    # one kv head: repeat and repeat_interleave are the same
    assert (
        "num_kv_heads=1 equals multi-head attention with each kv head copied to its group"
        not in failed
    )
    step = next(s for s in result.steps if s.title.startswith("Which query head"))
    assert "changed: query heads 0, 2" in step.checks[0].detail


def test_a_window_off_by_one_is_caught(monkeypatch):
    real = core.sliding_window_mask

    def wider(tokens, window, key_tokens=None, device=None):
        return real(tokens, window + 1, key_tokens, device)

    monkeypatch.setattr(core, "sliding_window_mask", wider)
    failed = _failed(run_demo("gqa"))
    for name in [
        "query i sees min(i + 1, 3) keys, in every head",
        "the visible keys of query i are i - 2 .. i",
        "the weights outside the window are exactly 0",
        "changing token 0 leaves rows 3.. of the output unchanged (outside their window)",
        "the fast path equals the explicit stages (window=3)",
    ]:
        assert name in failed, name


def test_alibi_with_other_slopes_or_the_wrong_sign_is_caught(monkeypatch):
    real_slopes, real_bias = AF.alibi_slopes, AF.alibi_bias
    monkeypatch.setattr(AF, "alibi_slopes", lambda n: real_slopes(2 * n)[:n])
    failed = _failed(run_demo("gqa"))
    assert "the slopes of 8 heads are ALiBi's published 1/2, 1/4, ..., 1/256" in failed
    assert "they are a geometric sequence: each is the one before times 2**(-8/8)" in failed
    monkeypatch.setattr(AF, "alibi_slopes", real_slopes)
    monkeypatch.setattr(AF, "alibi_bias", lambda *args: -real_bias(*args))
    failed = _failed(run_demo("gqa"))
    assert "biased_scores - scaled_scores is -slope * |query - key|" in failed
    assert "in every row the bias rises toward the query: near keys are favoured" in failed


def test_windowed_rows_check_fails_on_weight_outside_the_window():
    causal = torch.zeros(4, 4).masked_fill(AF.causal_mask(4), -torch.inf)
    w = torch.softmax(causal, -1)
    assert rows_are_distributions(w, causal, causal=True).ok
    check = rows_are_distributions(w, causal, causal=True, window=2)
    assert not check.ok and "outside the window of 2" in check.name
    windowed = torch.zeros(4, 4).masked_fill(AF.sliding_window_mask(4, 2), -torch.inf)
    banded = torch.softmax(windowed, -1)
    assert rows_are_distributions(banded, windowed, causal=True, window=2).ok


def test_gqa_part_constants_are_the_published_ones():
    assert tuple(2.0**-k for k in range(1, 9)) == gqa_part.ALIBI_SLOPES_8
