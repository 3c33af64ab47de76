"""What GroupedQueryAttention's readability costs, and how long checking a Llama-sized layer
takes. Not a test: run it by hand (see benchmarks/README.md).

    python benchmarks/bench_grouped.py            # batch 4, 512 tokens, d 2048, 32 heads, 8 kv
    python benchmarks/bench_grouped.py --quick    # batch 2, 128 tokens, d 512, 8 heads, 2 kv

Implementations, all with the same weights, causal, rotary, float32, CPU, no grad, eval:

  fast      GroupedQueryAttention(use_fast_path=True): projections, rotation, SDPA(enable_gqa)
  baseline  the same Linear layers, the rotation from tables made once, a bare SDPA(enable_gqa)
  explicit  GroupedQueryAttention(use_fast_path=False): every stage spelled out
  book      llms_from_scratch.llama3.GroupedQueryAttention (the book's code)

Timing as in bench_attention.py: warm-up, then every repeat runs each once in an order
rotated by one, medians reported, ratios in the same run. Target: fast/baseline <= 1.05.
Then ``attnscope.check`` on a Llama-sized layer (d 2048, 32 heads, 8 kv heads, 128 tokens),
imports excluded; target: under 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnscope.functional as AF
from attnscope import GroupedQueryAttention, check


def build(batch, tokens, d, heads, kv) -> tuple[dict[str, Callable], torch.Tensor]:
    torch.manual_seed(0)
    fast = GroupedQueryAttention(d, d, heads, kv).eval()
    explicit = GroupedQueryAttention(d, d, heads, kv, use_fast_path=False).eval()
    explicit.load_state_dict(fast.state_dict())
    x = torch.randn(batch, tokens, d)
    hd = d // heads
    angles = AF.rope_angles(tokens, fast.inv_freq)
    cos, sin = angles.cos().float(), angles.sin().float()  # the tables, made once

    def baseline(x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = fast.W_query(x).view(b, t, heads, hd).transpose(1, 2)
        k = fast.W_key(x).view(b, t, kv, hd).transpose(1, 2)
        v = fast.W_value(x).view(b, t, kv, hd).transpose(1, 2)
        q, k = AF.rotate_pairs(q, cos, sin, "half"), AF.rotate_pairs(k, cos, sin, "half")
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return fast.out_proj(ctx.transpose(1, 2).reshape(b, t, d))

    impls: dict[str, Callable] = {"fast": fast, "baseline": baseline, "explicit": explicit}
    try:
        from llms_from_scratch import llama3

        book = llama3.GroupedQueryAttention(d, d, heads, kv).eval()
        for name in ("W_query", "W_key", "W_value", "out_proj"):
            getattr(book, name).load_state_dict(getattr(fast, name).state_dict())
        book_cos, book_sin = llama3.compute_rope_params(hd, context_length=tokens)
        mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), diagonal=1)
        impls["book"] = lambda x: book(x, mask, book_cos, book_sin)
    except ImportError:
        pass
    with torch.no_grad():
        want = fast(x)
        for name, f in impls.items():
            torch.testing.assert_close(f(x), want, rtol=1e-4, atol=1e-4, msg=name)
    return impls, x


def time_all(impls, x, repeats, warmup) -> dict[str, list[float]]:
    names = list(impls)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for _ in range(warmup):
            for f in impls.values():
                f(x)
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                impls[name](x)
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    size = (2, 128, 512, 8, 2) if a.quick else (4, 512, 2048, 32, 8)
    impls, x = build(*size)
    times = time_all(impls, x, a.repeats, a.warmup)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(f"batch {size[0]}, {size[1]} tokens, d {size[2]}, {size[3]} heads, {size[4]} kv heads")
    print("| implementation | median ms | min ms | max ms |\n|---|---:|---:|---:|")
    for n, t in times.items():
        print(f"| {n} | {med[n]:.1f} | {min(t) * 1e3:.1f} | {max(t) * 1e3:.1f} |")
    print(f"fast / baseline = {med['fast'] / med['baseline']:.3f} (target <= 1.05)")
    if "book" in med:
        print(f"explicit / book = {med['explicit'] / med['book']:.3f}")

    torch.manual_seed(0)
    layer = GroupedQueryAttention(2048, 2048, 32, 8).eval()
    check(lambda: layer, tokens=8)  # warm the checker's own code paths
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        report = check(lambda: layer, tokens=128)
        runs.append(time.perf_counter() - start)
    print(
        f"check, Llama-sized layer (d 2048, 32 heads, 8 kv heads, 128 tokens): "
        f"median {statistics.median(runs):.2f} s (runs {', '.join(f'{r:.2f}' for r in runs)}); "
        f"ok={report.ok}, structure={report.structure}"
    )


if __name__ == "__main__":
    main()
