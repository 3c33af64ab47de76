"""How `attnscope check` does on a folder of cases with ``EXPECT`` dicts.

    python benchmarks/accuracy.py tests/unseen/r4              # kind given, then inferred
    python benchmarks/accuracy.py tests/unseen/r4 --verbose    # one line per file

Each case is a correct file (``ok: True``), a buggy one (``stage``/``mistake``) or an
unsupported one (``unsupported``: the check must refuse with exit 2). A correct file passes,
raises a false alarm (exit 1) or is refused (exit 2); a buggy one gets its stage and code
right, or not, or is refused; an unsupported one is refused, or given a verdict. Anything
else attnscope raises is a crash. ``layer`` (the module path of the attention inside a
wrapper) is held against the report's ``checked`` path where one is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import layer_of, structure_differences  # noqa: E402  (the tests' own)


def expectations(folder: Path) -> list[tuple[Path, dict]]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_case_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, "EXPECT"):
            found.append((path, module.EXPECT))
    return found


def judge(path: Path, expect: dict, infer: bool, timeout: float) -> tuple[str, str]:
    """``(verdict, what the checker said)``; verdict is one of the categories above."""
    from attnscope import AttnScopeError, check

    kind = None if infer else expect.get("kind")
    try:
        report = check(
            f"{path}:{expect['target']}", kind=kind, init=expect.get("init"), timeout=timeout
        )
    except AttnScopeError as exc:
        said = f"exit 2: {str(exc).splitlines()[0][:160]}"
        if expect.get("unsupported"):  # refused, and saying what is not modelled
            return ("refused-right" if "not supported yet" in said else "refused-unclear"), said
        return "refused", said
    except Exception as exc:  # a crash is what this measures
        return "crash", f"{type(exc).__name__}: {exc}"[:200]
    report = layer_of(report, expect.get("layer"))  # one layer of a whole model
    got = (
        "ok" if report.ok else f"{report.first_failure.stage.value}/{report.first_failure.mistake}"
    )
    if expect.get("unsupported"):
        return "verdict-on-unsupported", got
    if expect.get("ok"):
        if report.ok and expect.get("structure"):
            wrong = structure_differences(expect["structure"], report.structure or {})
            if wrong:
                return "pass-structure-wrong", f"ok; structure {wrong}"
        return ("pass" if report.ok else "false-alarm"), got
    if report.ok:
        return "missed", got
    stage_ok = report.first_failure.stage.value == expect["stage"]
    code_ok = stage_ok and report.first_failure.mistake == expect["mistake"]
    return ("code-right" if code_ok else "stage-right" if stage_ok else "wrong-stage"), got


def summary(rows: list[tuple[str, dict, str, str]]) -> str:
    correct = [r for r in rows if r[1].get("ok") and not r[1].get("unsupported")]
    buggy = [r for r in rows if not r[1].get("ok") and not r[1].get("unsupported")]
    unsup = [r for r in rows if r[1].get("unsupported")]
    c = Counter(r[2] for r in rows)
    stage = c["code-right"] + c["stage-right"]
    lines = [
        f"correct {len(correct)}: passed {c['pass'] + c['pass-structure-wrong']} "
        f"(structure right {c['pass']}), false alarms {c['false-alarm']}, "
        f"refused {sum(r[2] == 'refused' for r in correct)}, "
        f"crashed {sum(r[2] == 'crash' for r in correct)}",
        f"buggy {len(buggy)}: stage right {stage} ({stage / max(len(buggy), 1):.0%}), "
        f"mistake right {c['code-right']} ({c['code-right'] / max(len(buggy), 1):.0%}), "
        f"passed as correct {c['missed']}, "
        f"refused {sum(r[2] == 'refused' for r in buggy)}, "
        f"crashed {sum(r[2] == 'crash' for r in buggy)}",
        f"unsupported {len(unsup)}: refused naming it {c['refused-right']}, "
        f"refused otherwise {c['refused-unclear']}, "
        f"given a verdict {c['verdict-on-unsupported']}, "
        f"crashed {sum(r[2] == 'crash' for r in unsup)}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--verbose", action="store_true", help="one line per file")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--only", choices=["given", "inferred"], help="one of the two passes")
    args = parser.parse_args(argv)
    cases = [case for folder in args.folders for case in expectations(folder)]
    passes = [("given", False), ("inferred", True)]
    if args.only:
        passes = [p for p in passes if p[0] == args.only]
    for label, infer in passes:
        rows = []
        start = time.perf_counter()
        for path, expect in cases:
            verdict, said = judge(path, expect, infer, args.timeout)
            rows.append((path.stem, expect, verdict, said))
            if args.verbose and verdict not in ("pass", "code-right", "refused-right"):
                want = (
                    f"unsupported {expect['unsupported']}"
                    if expect.get("unsupported")
                    else "ok"
                    if expect.get("ok")
                    else f"{expect['stage']}/{expect['mistake']}"
                )
                print(f"  {verdict:22} {path.stem}: want {want}; got {said}", file=sys.stderr)
        took = time.perf_counter() - start
        print(f"== kind {label} ({took:.0f} s)\n{summary(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
