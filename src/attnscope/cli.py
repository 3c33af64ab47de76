"""The ``attnscope`` command: demo, trace, plot, check.

Exit codes: 0 everything passed, 1 a check failed, 2 a user error (bad arguments, a bad
input file, an output file that exists without ``--force``). User errors print one line,
``attnscope: error: ...``, to stderr and never a traceback. Output files are claimed
before anything is computed, so a long run never ends in "file exists".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ._version import __version__
from .checking.engine import DEFAULT_TIMEOUT
from .errors import SEED_MAX, SEED_MIN, AttnScopeError
from .render import claim_output
from .stages import MATRIX_STAGES

__all__ = ["main", "build_parser"]

_FIGURE_SUFFIXES = (".png", ".svg")
_WEIGHT_ROLES = ("query", "key", "value", "qkv", "kv", "out")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"attnscope: error: {message} (see '{self.prog} --help')\n")


# --- argument types ---------------------------------------------------------------------------


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _seed(text: str) -> int:
    """A seed ``torch.manual_seed`` accepts: an integer from -2**63 to 2**64 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"expected a seed from -2**63 to 2**64 - 1 (what torch.manual_seed accepts), got {text}"
        )
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _timeout(text: str) -> float | None:
    """``--timeout S``: a positive number of seconds, or 0 for none."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value == 0:
        return None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds (0 for no limit), got {text!r}"
        )
    return value


def _rows(text: str) -> list[int]:
    """``--rows 0,4095``: query positions, comma-separated (checked against the tokens
    once the input is loaded)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        rows = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected query positions separated by commas, like 0,4095, got {text!r}"
        ) from None
    if any(r < 0 for r in rows):
        raise argparse.ArgumentTypeError(f"expected positions from 0, got {text!r}")
    return rows


def _highlight(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        row, col = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ROW,COL as two integers like 1,1, got {text!r}"
        ) from None
    return row, col


# --- the parser -------------------------------------------------------------------------------


def _add_input(p: argparse.ArgumentParser, *, token: bool = True) -> None:
    g = p.add_argument_group("input")
    g.add_argument(
        "--input",
        metavar="FILE",
        help="embeddings, one row per token: .pt, .npy or .csv (default: the book's six tokens)",
    )
    labels = g.add_mutually_exclusive_group()
    labels.add_argument("--labels", metavar="A,B,C", help="token labels, comma-separated")
    labels.add_argument("--labels-file", metavar="FILE", help="token labels, one per line")
    if token:
        g.add_argument(
            "--token",
            type=_int_at_least(0),
            metavar="N",
            help="the query token's position, from 0 (default 1, the book's 'journey')",
        )


def _add_module(p: argparse.ArgumentParser) -> None:
    """--kind, --seed, --d-out, --heads and gqa's options: the module trace and plot build."""
    from .demo import GQA_DEFAULTS, TRACE_KINDS

    p.add_argument(
        "--kind",
        choices=TRACE_KINDS,
        default="self",
        help="default: self; gqa is a causal GroupedQueryAttention with rotary embeddings",
    )
    p.add_argument("--seed", type=_seed, default=123, help="torch.manual_seed (default 123)")
    p.add_argument(
        "--d-out",
        type=_int_at_least(1),
        metavar="N",
        help=f"default 2 (gqa: {GQA_DEFAULTS['d_out']})",
    )
    p.add_argument(
        "--heads",
        type=_int_at_least(1),
        metavar="N",
        help=f"multi-head and gqa only; default 2 (gqa: {GQA_DEFAULTS['heads']})",
    )
    g = p.add_argument_group("gqa (GroupedQueryAttention) only")
    g.add_argument(
        "--kv-heads",
        type=_int_at_least(1),
        metavar="N",
        help="key/value heads, a divisor of --heads (default: half of them, or all of an "
        "odd count)",
    )
    g.add_argument(
        "--window",
        type=_int_at_least(1),
        metavar="N",
        help="a sliding window: each query sees its last N keys, itself included",
    )
    g.add_argument(
        "--alibi", action="store_true", help="ALiBi's per-head bias instead of rotary embeddings"
    )


def _module_options(args) -> dict:
    """make_trace's sizes and options from --d-out, --heads and gqa's options."""
    if args.kind != "gqa":
        given = [
            flag
            for flag, value in (
                ("--kv-heads", args.kv_heads),
                ("--window", args.window),
                ("--alibi", args.alibi),
            )
            if value not in (None, False)
        ]
        if given:
            raise AttnScopeError(
                f"{', '.join(given)}: expected only with --kind gqa, got --kind {args.kind}"
            )
    return {
        "seed": args.seed,
        "d_out": args.d_out,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "window": args.window,
        "alibi": args.alibi,
    }


def _add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="replace output files that exist")


def build_parser() -> argparse.ArgumentParser:
    from .demo import DEMO_KINDS

    parser = _Parser(
        prog="attnscope",
        description="Self-attention for PyTorch that shows its work.",
        epilog="exit codes: 0 all passed, 1 a check failed, 2 a usage or input error",
    )
    parser.add_argument("--version", action="version", version=f"attnscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="predict, then check: the whole pipeline on the book's example",
        description="Walk the attention pipeline step by step: predict each shape and value, "
        "then see it and the checks the seeds name. Default: simplified, then self-attention "
        "(SelfAttentionV1), with the book's numbers.",
    )
    demo.add_argument(
        "--kind",
        choices=(*DEMO_KINDS, "all"),
        help="one part of the walk, or all of them (default: simplified then self; "
        "causal-multihead is the book's MultiHeadAttention, multihead has no causal mask; "
        "rope and gqa walk rotary embeddings and grouped-query attention)",
    )
    demo.add_argument("--seed", type=_seed, help="seed for the modules (default: the book's)")
    _add_input(demo)
    demo.add_argument("--html", metavar="FILE", help="also write an HTML report")
    _add_force(demo)
    demo.set_defaults(func=_cmd_demo)

    tr = sub.add_parser(
        "trace",
        help="every stage on your own input: predicted and actual shapes, values",
        description="Trace a reference module on your embeddings: each stage's predicted shape "
        "with its rule, its actual shape, its values when small, and the single-query walk.",
    )
    _add_module(tr)
    _add_input(tr)
    tr.add_argument(
        "--rows",
        type=_rows,
        metavar="I,J",
        help="a row trace: keep the scores and weights of these queries only (from 0, "
        "comma-separated), computed without the tokens x tokens matrix; the context in "
        "linear memory, with every query's summary",
    )
    tr.add_argument("--html", metavar="FILE", help="also write an HTML report")
    _add_force(tr)
    tr.set_defaults(func=_cmd_trace)

    plot = sub.add_parser(
        "plot",
        help="a heatmap of one stage, or the pipeline figure, as .png or .svg",
        description="Draw a stage as a heatmap (rows are queries, columns keys) or, with "
        "--pipeline, the pipeline figure with this input's real shapes.",
    )
    _add_module(plot)
    _add_input(plot, token=False)
    plot.add_argument(
        "--stage",
        choices=[s.value for s in MATRIX_STAGES],
        help="the stage to draw (default: weights)",
    )
    plot.add_argument(
        "--highlight", type=_highlight, metavar="ROW,COL", help="outline one cell, e.g. 1,1"
    )
    plot.add_argument(
        "--reduce",
        choices=("max", "mean"),
        default="max",
        help="past 128 tokens a cell is a tile of (query, key) pairs: draw their max "
        "(default) or mean",
    )
    plot.add_argument("--pipeline", action="store_true", help="draw the pipeline figure instead")
    plot.add_argument("-o", "--output", required=True, metavar="FILE", help="FILE.png or FILE.svg")
    _add_force(plot)
    plot.set_defaults(func=_cmd_plot)

    from .stages import KINDS

    check = sub.add_parser(
        "check",
        help="run someone's attention code and name the first stage that goes wrong",
        description="Check an attention implementation against the reference pipeline, stage "
        "by stage, stopping at the first stage that diverges. The layer's structure (queries, "
        "keys, values, heads, output projection, causal mask) is read from what it computes; "
        "a wrapper, block or decoder layer is searched for the attention it holds. A layer "
        "with something not modelled yet (rotary positions, grouped heads, ...) is refused.",
        epilog="TARGET is path/to/file.py:NAME or package.module:NAME, NAME being an nn.Module "
        "class (built from constructor arguments inferred from their names, or --init), a "
        "zero-argument function that returns a module, a module instance, or a plain function "
        "f(inputs) (--kind simplified) or f(inputs, query_index) (--kind scores). Examples: "
        "attnscope check model.py:CausalSelfAttention; attnscope check model.py:Block; "
        "attnscope check mypkg.layers:make_attention --json. Exit codes: 0 correct, 1 a "
        "divergence found, 2 the check could not be done (with one message).",
    )
    check.add_argument("target", metavar="TARGET", help="the implementation to check (see below)")
    check.add_argument("--kind", choices=KINDS, help="the kind of attention (default: inferred)")
    check.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object (also when the check cannot be done: exit 2 "
        'prints {"ok": false, "target": ..., "error": {"message": ...}})',
    )
    check.add_argument(
        "--init",
        metavar="JSON",
        help="constructor arguments as a JSON object, e.g. '{\"d_in\": 3}'",
    )
    check.add_argument(
        "--seed", type=_seed, default=0, help="seed for the probe inputs (default 0)"
    )
    check.add_argument(
        "--timeout",
        type=_timeout,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"give up when one call of the target takes more than S seconds (default "
        f"{DEFAULT_TIMEOUT:g}; 0 for no limit)",
    )
    check.add_argument(
        "--weights",
        metavar="query=NAME,key=NAME,value=NAME,out=NAME",
        help="override which parameters or submodules hold the projection weights (they are "
        "found from the computation; names only break ties)",
    )
    check.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help="probe length (default: a small length unlike every other size)",
    )
    check.add_argument(
        "--decode",
        choices=("hf", "buffers", "cache", "none"),
        help="a whole model: how to drive its key/value cache for the decoding check: hf "
        "(use_cache and past_key_values), buffers (use_cache and reset_kv_cache(), the cache "
        "kept in the model), cache (a KVCache passed as cache=), none (skip it); default: "
        "read from the model's forward",
    )
    check.add_argument("--html", metavar="FILE", help="also write an HTML report")
    _add_force(check)
    check.set_defaults(func=_cmd_check)
    return parser


# --- shared steps -------------------------------------------------------------------------------


def _claim_output(path: str, force: bool, inputs: Sequence[str | None] = ()) -> Path:
    """Check an output path before any work: new (or ``--force``), in an existing folder."""
    out = Path(path)
    for given in inputs:
        if given is not None and out.exists() and out.resolve() == Path(given).resolve():
            raise AttnScopeError(
                f"{out}: expected an output file, got the input file itself; choose another name"
            )
    return claim_output(out, overwrite=force)


def _claim(args, path: str) -> Path:
    """:func:`_claim_output` for a command's output, guarding the files it reads."""
    inputs = [getattr(args, "input", None), getattr(args, "labels_file", None)]
    return _claim_output(path, args.force, inputs)


def _load(args):
    """``(x, labels, from_book)`` from --input and --labels/--labels-file."""
    from .examples import BOOK_TOKENS, book_embeddings
    from .inputs import load_embeddings, parse_labels, read_labels_file, resolve_labels

    given = None
    if args.labels is not None:
        given = parse_labels(args.labels)
    elif args.labels_file is not None:
        given = read_labels_file(args.labels_file)
    if args.input is None:
        x = book_embeddings()
        labels = resolve_labels(given, None, x.shape[0], default=BOOK_TOKENS)
        return x, labels, True
    emb = load_embeddings(args.input)
    labels = resolve_labels(given, emb.labels, emb.tokens)
    return emb.tensor, labels, False


def _emit(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


# --- commands -----------------------------------------------------------------------------------


def _cmd_demo(args) -> int:
    from .demo import default_token, run_demo
    from .render.html import trace_html
    from .render.text import demo_text

    html = _claim(args, args.html) if args.html else None
    x, labels, from_book = _load(args)
    if not from_book and x.dim() != 2:
        raise AttnScopeError(
            f"{args.input}: expected (tokens, d_in) for the demo, got shape {tuple(x.shape)}; "
            "use 'attnscope trace' for batches"
        )
    token = default_token(x.shape[-2], args.token, name="--token", negative=False)
    result = run_demo(
        args.kind, x=None if from_book else x, labels=labels, token=token, seed=args.seed
    )
    _emit(demo_text(result))
    if html is not None:
        checks = [c.as_tuple() for c in result.checks]
        trace_html(
            result.main_trace,
            str(html),
            checks=checks,
            title="attnscope demo: predict, then check",
            overwrite=args.force,
            token=result.token,
        )
        print(f"wrote {html}", file=sys.stderr)
    return 0 if result.ok else 1


def _cmd_trace(args) -> int:
    from .demo import default_token, make_trace, trace_checks
    from .render.html import trace_html
    from .render.text import trace_text

    html = _claim(args, args.html) if args.html else None
    x, labels, _ = _load(args)
    rows = None
    if args.rows is not None:
        from .functional import check_rows

        rows = list(check_rows(args.rows, x.shape[-2], name="--rows"))
        if args.token is not None and args.token not in rows:
            raise AttnScopeError(
                f"--token: expected one of --rows {','.join(map(str, rows))} (a row trace "
                f"walks a chosen query), got {args.token}"
            )
    tr = make_trace(args.kind, x, labels=labels, rows=rows, **_module_options(args))
    if rows is not None and args.token is None:
        token = rows[0]
    else:
        token = default_token(tr.dims.tokens, args.token, name="--token", negative=False)
    checks = [c.as_tuple() for c in trace_checks(tr, token)]
    _emit(trace_text(tr, token=token, checks=checks))
    if html is not None:
        trace_html(
            tr,
            str(html),
            checks=checks,
            title=f"attnscope trace: {tr.kind}",
            overwrite=args.force,
            token=token,
        )
        print(f"wrote {html}", file=sys.stderr)
    return 0 if all(ok for _, ok, _ in checks) else 1


def _cmd_plot(args) -> int:
    from .demo import make_trace
    from .stages import stages_for_kind

    out = _claim(args, args.output)
    if out.suffix.lower() not in _FIGURE_SUFFIXES:
        raise AttnScopeError(
            f"{out}: expected a file ending in {', '.join(_FIGURE_SUFFIXES)}, got "
            f"{out.suffix or 'no suffix'!r}"
        )
    if args.pipeline and (args.stage or args.highlight):
        raise AttnScopeError(
            "--pipeline draws the whole pipeline; --stage and --highlight are for heatmaps"
        )
    stage = args.stage or "weights"
    if args.kind == "gqa":
        if stage == "biased_scores" and not args.alibi:
            raise AttnScopeError(
                "--stage: a gqa trace has biased_scores only with --alibi (the ALiBi bias)"
            )
    elif args.kind != "simplified" and stage not in [s.value for s in stages_for_kind(args.kind)]:
        needs = {
            "biased_scores": "--kind gqa --alibi",
            "masked_scores": "--kind causal, causal-multihead or gqa",
        }[stage]
        raise AttnScopeError(f"--stage: a {args.kind} trace has no {stage}; {stage} needs {needs}")
    if args.kind == "simplified" and stage not in ("scores", "weights"):
        raise AttnScopeError(f"--stage: simplified attention has scores and weights, not {stage}")
    from .render.figures import HEATMAP_CELLS

    x, labels, _ = _load(args)
    # a long input is pooled into tiles computed block by block from a row trace's queries
    # and keys: no (tokens x tokens) matrix is ever held
    long = x.shape[-2] > HEATMAP_CELLS
    rows = [x.shape[-2] - 1] if long else None
    tr = make_trace(args.kind, x, labels=labels, rows=rows, **_module_options(args))
    if args.highlight is not None:
        row, col = args.highlight
        t = tr.dims.tokens
        if not (0 <= row < t and 0 <= col < t):
            raise AttnScopeError(
                f"--highlight: expected ROW,COL from 0 to {t - 1} (the input has {t} tokens), "
                f"got {row},{col}"
            )
    if args.pipeline:
        tr.pipeline_figure(path=str(out), overwrite=args.force)
    else:
        tr.plot(
            stage=stage,
            path=str(out),
            highlight=args.highlight,
            reduce=args.reduce,
            overwrite=args.force,
        )
    print(f"wrote {out}")
    return 0


def _parse_init(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AttnScopeError(f"--init: expected a JSON object, got invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise AttnScopeError(
            f'--init: expected a JSON object like \'{{"d_in": 3, "d_out": 2}}\', got '
            f"{type(value).__name__} {text!r}"
        )
    return value


def _parse_weights(text: str | None) -> dict[str, str] | None:
    if text is None:
        return None
    roles: dict[str, str] = {}
    for part in text.split(","):
        role, eq, name = (s.strip() for s in part.partition("="))
        if not eq or not role or not name:
            raise AttnScopeError(
                f"--weights: expected ROLE=NAME pairs like query=W_q,key=W_k, got {part!r}"
            )
        if role not in _WEIGHT_ROLES:
            raise AttnScopeError(
                f"--weights: expected roles among {', '.join(_WEIGHT_ROLES)}, got {role!r}"
            )
        if role in roles:
            raise AttnScopeError(f"--weights: {role!r} given twice")
        roles[role] = name
    return roles


def _cmd_check(args) -> int:
    from rich.console import Console

    from .checking import check

    try:
        html = _claim(args, args.html) if args.html else None
        init = _parse_init(args.init)
        weights = _parse_weights(args.weights)
        # progress on a terminal only; the target's own prints go to stderr, so that
        # standard output holds the report alone (one JSON object with --json)
        with (
            Console(stderr=True).status(f"checking {args.target} ..."),
            contextlib.redirect_stdout(sys.stderr),
        ):
            report = check(
                args.target,
                kind=args.kind,
                init=init,
                seed=args.seed,
                timeout=args.timeout,
                weights=weights,
                tokens=args.tokens,
                decode=args.decode,
            )
    except AttnScopeError as exc:
        if args.json:  # exit 2 still prints one object: the contract's error report
            error = {"ok": False, "target": args.target, "error": {"message": str(exc)}}
            _emit(json.dumps(error, indent=2))
        raise
    _emit(report.to_json() if args.json else report.to_text())
    if html is not None:
        report.to_html(str(html), overwrite=args.force)
        print(f"wrote {html}", file=sys.stderr)
    return 0 if report.ok else 1


# --- entry point ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command is None:  # plain `attnscope`: what it can do, not an error
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except AttnScopeError as exc:
        print(f"attnscope: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `attnscope demo | head`: the reader left; say nothing more.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (keeps interpreter exit quiet)
        return 1
    except OSError as exc:  # a full disk or a folder without write permission
        print(f"attnscope: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnscope: interrupted", file=sys.stderr)
        return 130
