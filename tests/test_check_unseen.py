"""attnscope check on tests/unseen/: rounds written apart from the checker, in the styles of
well-known public code (see each round's README). Their first-run numbers are in the README;
since then they are held here, verdict by verdict, with the kind given and inferred."""

from __future__ import annotations

import pytest
from conftest import ROOT, expectations, outcome, structure_differences, target_of, wanted

from attnscope import AttnScopeError, check

CASES = expectations(ROOT / "tests" / "unseen")

#: what the refusal of each feature not modelled yet must say
_FEATURE_WORDS = {
    "rotary": "rotary position embedding",
    "grouped": "grouped key/value heads",
    "alibi": "ALiBi",
    "window": "sliding-window",
    "relative_bias": "relative position bias",
    "cross": "cross-attention",
    "qk_norm": "QK norm",
    "fast_path": "fused fast path",
    "kv_cache": "KV cache",
}


#: features modelled since their round was written: those correct layers are now judged
_MODELLED = {"rotary", "grouped", "window", "qk_norm", "alibi", "cross"}


def _ids(cases):
    return [f"{p.parent.name}/{p.stem}" for p, _ in cases]


@pytest.mark.parametrize("infer", [False, True], ids=["given-kind", "inferred-kind"])
@pytest.mark.parametrize("path,expect", CASES, ids=_ids(CASES))
def test_unseen_case(path, expect, infer):
    """The verdict of the file's EXPECT: correct, or the stage and mistake; a layer inside a
    wrapper is named by its module path; a feature not modelled yet is refused, not judged."""
    kind = None if infer else expect["kind"]
    target = target_of(path, expect)
    if expect.get("unsupported") and expect["unsupported"] not in _MODELLED:
        with pytest.raises(AttnScopeError, match="not supported yet") as info:
            check(target, kind=kind, init=expect.get("init"))
        assert _FEATURE_WORDS[expect["unsupported"]] in str(info.value)
        return
    report = check(target, kind=kind, init=expect.get("init"))
    # a correct layer whose feature is modelled now: judged, and correct
    want = ("ok",) if expect.get("unsupported") else wanted(expect)
    assert outcome(report) == want, report.to_text(color=False)
    assert report.layer == expect.get("layer"), report.notes
    if report.ok and expect.get("structure"):  # what was read from the computation
        assert not structure_differences(expect["structure"], report.structure or {})
    if infer:  # rounds written before the kind cross existed said multihead for it
        kind = "cross" if expect.get("unsupported") == "cross" else expect["kind"]
        assert report.kind == kind, report.kind_reason
