"""attnscope check on further styles and bugs (tests/variants/): fused calls without the
causal flag, additive -10000 masks, bool keep-masks, raw square weights, heads under odd
names, per-head loops, functions returning weights instead of scores, and more."""

from __future__ import annotations

import pytest
from conftest import ROOT, outcome

from attnscope import check

HERE = ROOT / "tests" / "variants"

CASES = [
    ("sdpa_and_masks.py", "SdpaNoCausal", ("masked_scores", "missing_mask")),
    ("sdpa_and_masks.py", "SdpaScale1", ("scaled_scores", "missing_scale")),
    ("sdpa_and_masks.py", "OldHFMask", ("ok",)),
    ("sdpa_and_masks.py", "BoolKeepMask", ("ok",)),
    ("sdpa_and_masks.py", "ValuesFromKeyCombined", ("values", "wrong_projection")),
    ("sdpa_and_masks.py", "NoBiasInQuery", ("ok",)),
    ("sdpa_and_masks.py", "SoftmaxBatchDim", ("weights", "softmax_wrong_dim")),
    ("sdpa_and_masks.py", "TwoScale", ("scaled_scores", "wrong_scale")),
    ("sdpa_and_masks.py", "MaskFillNeg5", ("masked_scores", "mask_fill_value")),
    ("sdpa_and_masks.py", "RowSumAfterExp", ("ok",)),
    ("styles_and_functions.py", "RenormAfterSoftmax", ("ok",)),
    ("styles_and_functions.py", "PerHeadLoop", ("ok",)),
    ("styles_and_functions.py", "BaddbmmAlpha", ("ok",)),
    ("styles_and_functions.py", "HeadsMergeWrongAxis", ("output", "heads_merge")),
    ("styles_and_functions.py", "KeysRolled", ("scores", "wrong_key_index")),
    ("styles_and_functions.py", "OutProjTwice", ("output", "other")),
    ("styles_and_functions.py", "simplified_batch_first", ("ok",)),
    ("styles_and_functions.py", "simplified_scaled", ("scaled_scores", "wrong_scale")),
    ("styles_and_functions.py", "scores_with_softmax", ("scores", "not_dot_product")),
    ("styles_and_functions.py", "scores_cos", ("scores", "not_dot_product")),
    ("styles_and_functions.py", "scores_loop_manual", ("ok",)),
    ("layouts.py", "SquareRaw", ("ok",)),
    ("layouts.py", "HiddenHeads", ("ok",)),
    ("layouts.py", "KeepMask", ("ok",)),
    ("layouts.py", "UnbatchedOnlyMHA", ("ok",)),
]


@pytest.mark.parametrize("file,name,expected", CASES, ids=[c[1] for c in CASES])
def test_variant(file, name, expected):
    report = check(f"{HERE / file}:{name}")
    assert outcome(report) == expected, report.to_text(color=False)


def test_range_loss_without_overflow_is_a_note_not_a_failure():
    """Renormalising after the softmax loses range at large magnitude: said, not blamed."""
    report = check(f"{HERE / 'styles_and_functions.py'}:RenormAfterSoftmax")
    assert report.ok
    assert any("no exp overflow" in note for note in report.notes)
