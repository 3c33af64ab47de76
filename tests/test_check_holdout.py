"""Accuracy of attnscope check on implementations written apart from the checker.

tests/holdout/ was written by someone who did not read the checker; the checker was not
tuned on it. The issue's bar: no false alarm on a correct implementation, the stage right
for at least 95% of the buggy ones and the mistake code for at least 90%.
"""

from __future__ import annotations

from conftest import HOLDOUT, expectations, outcome, target_of, wanted

from attnscope import check


def _verdicts(infer_kind: bool):
    rows = []
    for path, expect in expectations(HOLDOUT):
        kind = None if infer_kind else expect["kind"]
        report = check(target_of(path, expect), kind=kind, init=expect.get("init"))
        rows.append((path.stem, expect, outcome(report)))
    return rows


def _rates(rows):
    correct = [(n, got) for n, e, got in rows if e.get("ok")]
    buggy = [(n, e, got) for n, e, got in rows if not e.get("ok")]
    false_alarms = [n for n, got in correct if got != ("ok",)]
    stage_right = sum(got[0] == e["stage"] for _, e, got in buggy) / len(buggy)
    code_right = sum(got == wanted(e) for _, e, got in buggy) / len(buggy)
    misses = [(n, wanted(e), got) for n, e, got in buggy if got != wanted(e)]
    return false_alarms, stage_right, code_right, misses


def test_holdout_accuracy_with_given_kind():
    false_alarms, stage_right, code_right, misses = _rates(_verdicts(infer_kind=False))
    assert false_alarms == []
    assert stage_right >= 0.95, misses
    assert code_right >= 0.90, misses


def test_holdout_accuracy_with_inferred_kind():
    false_alarms, stage_right, code_right, misses = _rates(_verdicts(infer_kind=True))
    assert false_alarms == []
    assert stage_right >= 0.95, misses
    assert code_right >= 0.90, misses
