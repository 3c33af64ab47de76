"""attnscope check on tests/adversarial/: a second independent round of cases written to
catch it out (see tests/adversarial/README.md). Every verdict is held, with the kind given
and inferred."""

from __future__ import annotations

import pytest
from conftest import ROOT, expectations, outcome, target_of, wanted

from attnscope import check

CASES = expectations(ROOT / "tests" / "adversarial")


@pytest.mark.parametrize("infer", [False, True], ids=["given-kind", "inferred-kind"])
@pytest.mark.parametrize("path,expect", CASES, ids=[p.stem for p, _ in CASES])
def test_adversarial_case(path, expect, infer):
    kind = None if infer else expect["kind"]
    report = check(target_of(path, expect), kind=kind, init=expect.get("init"))
    assert outcome(report) == wanted(expect), report.to_text(color=False)
    if infer:
        assert report.kind == expect["kind"], report.kind_reason
