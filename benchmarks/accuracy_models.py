"""How `attnscope check` does on a folder of whole models with ``EXPECT`` dicts.

    python benchmarks/accuracy_models.py tests/unseen/m1 --verbose

Each file's ``EXPECT`` names its ``target`` (a zero-argument factory), the attention
``layers`` in run order, and either ``ok: True`` (every layer and cached decoding correct),
an attention bug (``layer``, ``stage``, ``mistake``: the first failing layer) or a decoding
bug (``decode``: ``mistake``, ``step``, ``layer``). A correct model passes, raises a false
alarm or is refused; an attention bug gets its layer, stage and code right or not; a
decoding bug gets its code (and step, layer) right or not. The layers found must be the ones
named.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import expectations  # noqa: E402


def judge(path: Path, expect: dict, infer: bool) -> tuple[str, str]:
    """``(verdict, what the checker said)``."""
    from attnscope import AttnScopeError, ModelReport, check

    kind = None if infer else expect.get("kind")
    try:
        report = check(f"{path}:{expect['target']}", kind=kind)
    except AttnScopeError as exc:
        return "refused", f"exit 2: {str(exc).splitlines()[0][:200]}"
    except Exception as exc:  # a crash is what this measures
        return "crash", f"{type(exc).__name__}: {exc}"[:200]
    if not isinstance(report, ModelReport):
        return "not-a-model", f"a single-layer report of {report.layer or report.target}"
    found = [p for p, _ in report.layers]
    decode = report.decode
    said = [f"layers {len(found)}"]
    if report.first_failure is not None:
        f = report.first_failure
        said.append(f"first failure {report.first_layer} {f.stage.value}/{f.mistake}")
    if decode is not None:
        said.append(
            "decode ok"
            if decode.ok
            else f"decode {decode.mistake} step {decode.step} layer {decode.layer}"
        )
    else:
        said.append("no decoding")
    text = "; ".join(said)
    want = expect.get("layers")
    if want is not None and found != want:
        return "layers-wrong", f"{text}; found {found}, want {want}"
    if expect.get("ok"):
        if report.ok and expect.get("cache") and decode is None:
            return "pass-no-decode", text
        return ("pass" if report.ok else "false-alarm"), text
    if expect.get("decode"):
        d = expect["decode"]
        if report.first_failure is not None:
            return "false-alarm-layer", text
        if decode is None:
            return "decode-not-run", text
        if decode.ok:
            return "missed", text
        if decode.mistake != d["mistake"]:
            return "decode-wrong-code", text
        exact = decode.step == d.get("step") and decode.layer == d.get("layer")
        return ("decode-exact" if exact else "decode-code-right"), text
    if report.first_failure is None:
        return "missed", text
    if report.first_layer != expect["layer"]:
        return "wrong-layer", text
    f = report.first_failure
    if f.stage.value != expect["stage"]:
        return "wrong-stage", text
    return ("code-right" if f.mistake == expect["mistake"] else "stage-right"), text


def summary(rows: list[tuple[str, dict, str, str]]) -> str:
    correct = [r for r in rows if r[1].get("ok")]
    # a correct model may state its decoding as {"mistake": None}: no decoding bug
    decoding = [r for r in rows if (r[1].get("decode") or {}).get("mistake")]
    attention = [r for r in rows if not r[1].get("ok") and r not in decoding]
    c = Counter(r[2] for r in rows)
    layer = c["code-right"] + c["stage-right"] + c["wrong-stage"]
    stage = c["code-right"] + c["stage-right"]
    named = c["decode-exact"] + c["decode-code-right"]
    return "\n".join(
        [
            f"correct {len(correct)}: passed {c['pass']} (decoding not run on a cached model: "
            f"{c['pass-no-decode']}), false alarms "
            f"{sum(r[2] == 'false-alarm' for r in correct)}, refused "
            f"{sum(r[2] == 'refused' for r in correct)}",
            f"attention bugs {len(attention)}: layer right {layer}, stage right {stage}, "
            f"mistake right {c['code-right']}, missed "
            f"{sum(r[2] == 'missed' for r in attention)}, refused "
            f"{sum(r[2] == 'refused' for r in attention)}",
            f"decoding bugs {len(decoding)}: code right {named} (step and layer too: "
            f"{c['decode-exact']}), other code {c['decode-wrong-code']}, missed "
            f"{sum(r[2] == 'missed' for r in decoding)}, not decoded {c['decode-not-run']}, "
            f"a layer blamed {c['false-alarm-layer']}, refused "
            f"{sum(r[2] == 'refused' for r in decoding)}",
            f"layers found otherwise {c['layers-wrong']}, crashed {c['crash']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--verbose", action="store_true", help="one line per file")
    parser.add_argument("--only", choices=("given", "inferred"))
    args = parser.parse_args(argv)
    cases = [c for folder in args.folders for c in expectations(folder)]
    for infer in (False, True):
        if args.only == ("inferred" if not infer else "given"):
            continue
        start = time.perf_counter()
        rows = []
        for path, expect in cases:
            verdict, said = judge(path, expect, infer)
            rows.append((path.stem, expect, verdict, said))
            if args.verbose and verdict not in ("pass", "code-right", "decode-exact"):
                print(f"  {verdict:<20} {path.stem}: {said}")
        took = time.perf_counter() - start
        print(f"== kind {'inferred' if infer else 'given'} ({took:.0f} s)")
        print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
