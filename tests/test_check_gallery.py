"""attnscope check on the gallery: every correct style passes, every bug is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import GALLERY, expectations, outcome, target_of, wanted

from attnscope import check
from attnscope.checking import MISTAKES

CASES = expectations(GALLERY)


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
