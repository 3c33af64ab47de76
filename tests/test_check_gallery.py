"""attnscope check on the gallery: every correct style passes, every bug is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    GALLERY,
    expectations,
    is_model,
    model_outcome,
    model_wanted,
    outcome,
    target_of,
    wanted,
)

from attnscope import ModelReport, check
from attnscope.checking import MISTAKES
from attnscope.testing import AttentionMismatch, assert_attention

CASES = [(p, e) for p, e in expectations(GALLERY) if not is_model(e)]
MODELS = [(p, e) for p, e in expectations(GALLERY) if is_model(e)]


def test_gallery_covers_every_mistake_code():
    """One buggy file at least for each mistake code, classic and modern (each modern code
    from the moment the checker models it)."""
    codes = {e["mistake"] for _, e in CASES if not e.get("ok")}
    modelled = {code for code, m in MISTAKES.items() if not m.modern or m.mutate is not None}
    assert codes == modelled


def test_gallery_has_correct_files_of_every_kind():
    kinds = {e["kind"] for _, e in CASES if e.get("ok")}
    assert kinds == {
        "scores",
        "simplified",
        "self",
        "causal",
        "multihead",
        "causal-multihead",
        "cross",
    }


@pytest.mark.parametrize("path,expect", CASES, ids=[p.stem for p, _ in CASES])
def test_gallery_file_with_its_kind(path, expect):
    """Given the kind, the checker reaches the expected verdict (stage and mistake); a failing
    report walks the checklist in order and ends at the failing stage, with a message."""
    report = check(target_of(path, expect), kind=expect["kind"], init=expect.get("init"))
    assert outcome(report) == wanted(expect), report.to_text(color=False)
    assert report.kind == expect["kind"]
    if not report.ok:
        assert [c.ok for c in report.checks][-1] is False
        assert all(c.ok for c in report.checks[:-1])
        assert report.checks[-1].stage is report.first_failure.stage
        assert report.first_failure.message.startswith(report.first_failure.stage.value)


@pytest.mark.parametrize("path,expect", CASES, ids=[p.stem for p, _ in CASES])
def test_gallery_file_with_inferred_kind(path, expect):
    """Without --kind the kind is inferred, said with a reason, and the verdict is the same."""
    report = check(target_of(path, expect), init=expect.get("init"))
    assert report.kind == expect["kind"], report.kind_reason
    assert report.kind_reason
    assert outcome(report) == wanted(expect), report.to_text(color=False)


def test_wrong_scale_message_names_the_factor_used_and_expected():
    path = GALLERY / "buggy" / "self_scale_by_dk.py"
    report = check(f"{path}:SelfAttention", kind="self")
    msg = report.first_failure.message
    assert "1/d_k" in msg and "1/sqrt(d_k)" in msg


def test_failure_points_at_the_users_line():
    """The message names the line of the user's file where the wrong tensor was made."""
    path = GALLERY / "buggy" / "self_softmax_dim1.py"
    report = check(f"{path}:BatchedSelfAttention", kind="self")
    where, line = report.first_failure.location.rsplit(":", 1)
    assert Path(where).resolve() == path.resolve()
    line = int(line)
    source = path.read_text().splitlines()[line - 1]
    assert "softmax" in source


# --- whole models ---------------------------------------------------------------------------


def test_gallery_has_models_for_each_decode_code_and_a_later_layer_bug():
    decodes = set()
    for _, e in MODELS:
        d = e.get("decode")
        decodes.add(d["mistake"] if isinstance(d, dict) else d)
    assert {"ok", "cache_positions", "cache_stale", "cache_mask", "cache_other"} <= decodes
    assert any(e.get("layer") and not e["layer"].endswith(".0.attn") for _, e in MODELS)
    assert any(e.get("ok") for _, e in MODELS)


@pytest.mark.parametrize("path,expect", MODELS, ids=[p.stem for p, _ in MODELS])
def test_gallery_model(path, expect, report_schema):
    """A model: every attention layer checked where it sits (the first failing one named
    with its stage and mistake), and decoding with its cache (the code, step and layer);
    the report follows the contract."""
    import jsonschema

    report = check(target_of(path, expect), init=expect.get("init"))
    assert isinstance(report, ModelReport)
    jsonschema.validate(report.to_dict(), report_schema)
    assert model_outcome(report, expect) == model_wanted(expect), report.to_text(color=False)
    if report.decode is not None and not report.decode.ok:
        assert report.decode.location, report.decode.message


def test_assert_attention_names_the_failing_layer_of_a_model():
    """assert_attention on a whole model whose last layer (2) is wrong: an AssertionError
    whose text names the layer, the stage and the mistake."""
    path = GALLERY / "models" / "buggy_last_layer_wrong_scale.py"
    with pytest.raises(AssertionError, match="blocks.2.attn") as info:
        assert_attention(f"{path}:make_model")
    assert isinstance(info.value, AttentionMismatch)
    assert "first failing layer: blocks.2.attn" in str(info.value)
    assert "wrong_scale" in str(info.value)
    assert info.value.report.first_layer == "blocks.2.attn"
    assert assert_attention(f"{GALLERY / 'models' / 'correct_gpt_external_cache.py'}:make_model")


def test_assert_attention_fails_on_a_decoding_bug_alone():
    path = GALLERY / "models" / "buggy_cache_stale_updated_twice.py"
    with pytest.raises(AttentionMismatch, match="cache_stale"):
        assert_attention(f"{path}:make_model")
    assert assert_attention(f"{path}:make_model", decode="none").ok
