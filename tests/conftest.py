"""Shared test helpers: the gallery of implementations and the JSON contract."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GALLERY = ROOT / "examples" / "gallery"
HOLDOUT = ROOT / "tests" / "holdout"
SCHEMA = ROOT / "src" / "attnscope" / "data" / "check-report.schema.json"


def expectations(folder: Path) -> list[tuple[Path, dict]]:
    """Every ``*.py`` under ``folder`` with its module-level ``EXPECT`` dict."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_gallery_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, "EXPECT"):
            found.append((path, module.EXPECT))
    return found


def target_of(path: Path, expect: dict) -> str:
    return f"{path}:{expect['target']}"


def outcome(report) -> tuple:
    """``("ok",)`` or ``(stage, mistake)``: what a gallery file's EXPECT states."""
    if report.ok:
        return ("ok",)
    return (report.first_failure.stage.value, report.first_failure.mistake)


def structure_differences(want: dict, got: dict) -> str:
    """The fields of the expected ``structure`` the report read otherwise ('' if none)."""
    wrong = []
    for key, value in want.items():
        have = got.get(key)
        if isinstance(value, dict) and isinstance(have, dict):
            bad = [
                k
                for k, v in value.items()
                if not (
                    have.get(k) == v
                    or (
                        isinstance(v, (int, float))
                        and isinstance(have.get(k), (int, float))
                        and abs(have[k] - v) <= 1e-3 * abs(v)
                    )
                )
            ]
            if bad:
                wrong.append(f"{key}.{'/'.join(bad)}: want {value}, got {have}")
        elif have != value:
            wrong.append(f"{key}: want {value}, got {have}")
    return "; ".join(wrong)


def wanted(expect: dict) -> tuple:
    return ("ok",) if expect.get("ok") else (expect["stage"], expect["mistake"])


@pytest.fixture(scope="session")
def report_schema() -> dict:
    return json.loads(SCHEMA.read_text())
