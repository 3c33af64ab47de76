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


def layer_of(report, layer: str | None):
    """A single-layer case's verdict where the checker answered with a whole model's report
    (a decoder of vectors holding self- and cross-attention): the first failing layer's
    report where one fails, else the report of ``layer`` (the one the case names), each with
    its module path; any other report as it is."""
    import dataclasses

    from attnscope.checking.report import ModelReport

    if not isinstance(report, ModelReport):
        return report
    paths = dict(report.layers)
    path = report.first_layer if not report.ok and report.first_layer else layer
    if path not in paths:  # the case names a layer the model does not run: its first
        path = report.layers[0][0]
    return dataclasses.replace(paths[path], layer=path)


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


def is_model(expect: dict) -> bool:
    """A whole model's EXPECT (``kind: "model"``): checked layer by layer, and decoded."""
    return expect.get("kind") == "model"


def model_outcome(report, expect: dict) -> dict:
    """What a model's report says, in the terms of its EXPECT: ``ok``; ``layer``, ``stage``
    and ``mistake`` of the first failing attention layer (None where every layer passes);
    ``decode`` and, where the EXPECT states them, ``decode``'s ``step`` and ``layer``;
    ``layers`` where the EXPECT lists them."""
    failure = report.first_failure
    got = {
        "ok": report.ok,
        "layer": report.first_layer,
        "stage": None if failure is None else failure.stage.value,
        "mistake": None if failure is None else failure.mistake,
        "decode": _decode_of(report.decode, expect.get("decode")),
    }
    if "layers" in expect:
        got["layers"] = [path for path, _ in report.layers]
    return got


def model_wanted(expect: dict) -> dict:
    """A model EXPECT in the form of :func:`model_outcome`. ``layer``/``stage``/``mistake``
    name the first failing attention layer (absent: every layer passes); ``decode`` is the
    decoding verdict: ``"ok"`` (or True), a mistake code, a dict with ``mistake`` and
    optionally ``step`` and ``layer``, or None (absent) when the model is not decoded."""
    want = {
        "ok": bool(expect.get("ok")),
        "layer": expect.get("layer"),
        "stage": expect.get("stage"),
        "mistake": expect.get("mistake"),
        "decode": _decode_wanted(expect.get("decode")),
    }
    if "layers" in expect:
        want["layers"] = list(expect["layers"])
    return want


def _decode_wanted(decode) -> dict | None:
    if decode is None:
        return None
    if decode is True or decode == "ok":
        return {"mistake": None}
    if isinstance(decode, str):
        return {"mistake": decode}
    return {k: decode[k] for k in ("mistake", "step", "layer") if k in decode}


def _decode_of(decode, expected) -> dict | None:
    """The report's ``decode`` with the fields the EXPECT states."""
    if decode is None:
        return None
    want = _decode_wanted(expected) or {"mistake": None}
    got = {"mistake": decode.mistake, "step": decode.step, "layer": decode.layer}
    return {k: got[k] for k in want}


@pytest.fixture(scope="session")
def report_schema() -> dict:
    return json.loads(SCHEMA.read_text())
