"""The check report: its JSON contract, its text, exit codes, and the pytest helper."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import GALLERY, ROOT, SCHEMA

from attnscope import check
from attnscope.checking import MISTAKES
from attnscope.cli import main
from attnscope.stages import Stage
from attnscope.testing import AttentionMismatch, assert_attention

BUGGY = f"{GALLERY / 'buggy' / 'self_missing_scale.py'}:SelfAttention_v2"
CORRECT = f"{GALLERY / 'correct' / 'causal_book.py'}:CausalAttention"


def test_packaged_schema_is_the_shared_contract():
    """The schema shipped with the package is byte-for-byte the contract in shared/."""
    shared = ROOT.parent / "shared" / "contract" / "check-report.schema.json"
    if not shared.exists():
        pytest.skip("../shared/contract is not beside this checkout")
    assert json.loads(SCHEMA.read_text()) == json.loads(shared.read_text())


def test_packaged_vocabulary_is_the_shared_contract():
    """The vocabulary shipped beside the schema is the one in shared/."""
    shared = ROOT.parent / "shared" / "contract" / "VOCABULARY.md"
    if not shared.exists():
        pytest.skip("../shared/contract is not beside this checkout")
    assert (SCHEMA.parent / "VOCABULARY.md").read_text() == shared.read_text()


def test_contract_names_match_the_code(report_schema):
    """Stage names and mistake codes in the code are exactly the contract's."""
    stages = report_schema["$defs"]["stage"]["enum"]
    assert stages == [s.value for s in Stage]
    assert report_schema["$defs"]["mistake"]["enum"] == list(MISTAKES)


@pytest.mark.parametrize("target", [BUGGY, CORRECT])
def test_report_json_validates_against_the_contract(report_schema, target):
    report = check(target)
    jsonschema.validate(report.to_dict(), report_schema)
    assert json.loads(report.to_json()) == report.to_dict()


def test_every_gallery_report_validates(report_schema):
    for path in sorted((GALLERY / "buggy").glob("*.py"))[:8]:
        text = path.read_text()
        name = text.split('"target": "')[1].split('"')[0]
        jsonschema.validate(check(f"{path}:{name}").to_dict(), report_schema)


def test_cli_json_for_a_bug_exits_1_and_validates(capsys, report_schema):
    code = main(["check", BUGGY, "--json"])
    out = capsys.readouterr().out
    assert code == 1
    data = json.loads(out)
    jsonschema.validate(data, report_schema)
    assert data["first_failure"]["stage"] == "scaled_scores"
    assert data["first_failure"]["mistake"] == "missing_scale"
    assert data["ok"] is False and data["checks"][-1]["ok"] is False


def test_cli_correct_exits_0(capsys):
    assert main(["check", CORRECT]) == 0
    assert "pass" in capsys.readouterr().out


def test_cli_text_is_the_checklist(capsys):
    main(["check", BUGGY])
    out = capsys.readouterr().out
    for stage in ("queries", "keys", "values", "scores", "scaled_scores"):
        assert stage in out
    assert "weights" not in out.split("first failure")[0]  # stopped at the failure
    assert "missing_scale" in out


def test_cli_html_report(tmp_path, capsys):
    path = tmp_path / "check.html"
    assert main(["check", BUGGY, "--html", str(path)]) == 1
    html = path.read_text()
    assert "missing_scale" in html and "scaled_scores" in html


def test_module_entry_point_runs_a_check():
    """``python -m attnscope check`` works as a process, with the documented exit code."""
    proc = subprocess.run(
        [sys.executable, "-m", "attnscope", "check", BUGGY, "--json"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["first_failure"]["mistake"] == "missing_scale"


def test_assert_attention_passes_a_correct_layer():
    report = assert_attention(CORRECT, kind="causal")
    assert report.ok


def test_assert_attention_fails_with_the_report_text():
    with pytest.raises(AttentionMismatch) as info:
        assert_attention(BUGGY)
    assert "missing_scale" in str(info.value)
    assert info.value.report.first_failure.stage is Stage.SCALED_SCORES


def test_report_text_and_notebook_html():
    report = check(BUGGY)
    assert "missing_scale" in str(report)
    assert "<" in report._repr_html_()


def test_check_restores_the_callers_thread_count():
    """check() runs small probes on one thread (far faster on a busy CPU) and gives it back."""
    import torch

    before = torch.get_num_threads()
    check(CORRECT)
    assert torch.get_num_threads() == before
