"""How much attnscope's readability costs: five ways to run the same multi-head attention.

Not a test: run it by hand (see benchmarks/README.md).

    python benchmarks/bench_attention.py            # batch 8, 1024 tokens, d 768, 12 heads
    python benchmarks/bench_attention.py --quick    # batch 2, 128 tokens, d 256, 4 heads

Implementations, all with the same weights, causal, float32, CPU, no grad, eval mode:

  fast      MultiHeadAttention(use_fast_path=True): projections + scaled_dot_product_attention
  baseline  the same module's Linear layers + a bare F.scaled_dot_product_attention call
  explicit  MultiHeadAttention(use_fast_path=False): every stage spelled out
  book      llms_from_scratch.ch03.MultiHeadAttention (the book's code)
  trace     module.trace(x): the explicit path, keeping every stage

Each is warmed up first; then every repeat runs all of them once, in an order rotated by
one per repeat, so drifting load (thermal, other processes) hits them equally. Medians are
reported, with the ratios the project targets: fast/baseline <= 1.10, explicit/book <= 1.10,
trace/explicit <= 1.5.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnscope import MultiHeadAttention

TARGETS = {
    ("fast", "baseline"): 1.10,
    ("explicit", "book"): 1.10,
    ("trace", "explicit"): 1.5,
}


def build(batch: int, tokens: int, d: int, heads: int) -> tuple[dict[str, Callable], torch.Tensor]:
    """The implementations, sharing one set of weights, and the input ``(batch, tokens, d)``."""
    torch.manual_seed(123)
    fast = MultiHeadAttention(d, d, tokens, 0.0, num_heads=heads).eval()
    explicit = MultiHeadAttention(d, d, tokens, 0.0, num_heads=heads, use_fast_path=False).eval()
    explicit.load_state_dict(fast.state_dict())
    x = torch.randn(batch, tokens, d)

    def baseline(x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = d // heads
        q, k, v = (
            lin(x).view(b, t, heads, hd).transpose(1, 2)  # (B, H, T, hd)
            for lin in (fast.W_query, fast.W_key, fast.W_value)
        )
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return fast.out_proj(context.transpose(1, 2).reshape(b, t, d))

    impls: dict[str, Callable] = {
        "fast": fast,
        "baseline": baseline,
        "explicit": explicit,
    }
    try:
        from llms_from_scratch.ch03 import MultiHeadAttention as BookMHA
    except ImportError:
        print("llms_from_scratch is not installed: skipping 'book'")
    else:
        book = BookMHA(d, d, tokens, 0.0, num_heads=heads).eval()
        book.load_state_dict(fast.state_dict())
        impls["book"] = book
    impls["trace"] = explicit.trace
    return impls, x


def check_agree(impls: dict[str, Callable], x: torch.Tensor) -> None:
    """Refuse to time implementations that do not compute the same thing."""
    with torch.no_grad():
        ref = impls["explicit"](x)
        for name, fn in impls.items():
            out = fn(x)
            out = out.result if name == "trace" else out
            diff = (out - ref).abs().max().item()
            if diff > 1e-4:
                raise SystemExit(f"{name} differs from explicit by {diff:.2e}: not timing it")


def run(
    impls: dict[str, Callable], x: torch.Tensor, repeats: int, warmup: int
) -> dict[str, list[float]]:
    from rich.console import Console
    from rich.progress import track

    times: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    with torch.no_grad():
        for _ in range(warmup):
            for name in names:
                impls[name](x)
        # progress on stderr (a terminal only): the tables on stdout stay clean
        for r in track(
            range(repeats), description="repeats", transient=True, console=Console(stderr=True)
        ):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                gc.collect()  # free the previous result before the clock starts
                start = time.perf_counter()
                out = impls[name](x)
                times[name].append(time.perf_counter() - start)
                del out
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 2, 128 tokens, d 256, 4 heads")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.tokens, args.d, args.heads = 2, 128, 256, 4

    impls, x = build(args.batch, args.tokens, args.d, args.heads)
    check_agree(impls, x)
    times = run(impls, x, args.repeats, args.warmup)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, "
        f"{args.tokens} tokens, d {args.d}, {args.heads} heads, float32, causal, no grad; "
        f"median of {args.repeats} (after {args.warmup} warm-up)"
    )
    print()
    print("| implementation | median ms | min ms | max ms |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {med[name] * 1e3:.1f} | {min(ts) * 1e3:.1f} | {max(ts) * 1e3:.1f} |")
    print()
    print("| ratio | measured | target | |")
    print("|---|---:|---:|---|")
    for (a, b), target in TARGETS.items():
        if a in med and b in med:
            ratio = med[a] / med[b]
            verdict = "met" if ratio <= target else "MISSED"
            print(f"| {a} / {b} | {ratio:.3f} | <= {target:.2f} | {verdict} |")


if __name__ == "__main__":
    main()
