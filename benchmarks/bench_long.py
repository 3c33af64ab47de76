"""Long sequences: time and peak memory of the blocked core and of row traces.

Each configuration runs in its own subprocess, so that its peak resident memory (``VmHWM``
in ``/proc/self/status``; torch's CPU tensors escape ``tracemalloc``) is its own. Reported:
wall time of the measured call (best of ``--repeat``), and the peak memory above what the
process held before the call (module, input, interpreter).

    python benchmarks/bench_long.py                 # 4,096 tokens; 16,384 for the row trace
    python benchmarks/bench_long.py --long 65536    # the row trace against the fast path at 64k

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

D_MODEL, HEADS = 768, 12


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_one(config: str, tokens: int, repeat: int, block: int) -> dict:
    import torch

    import attnscope
    import attnscope.functional as AF

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    x = torch.randn(1, tokens, D_MODEL)
    # GroupedQueryAttention without rotation and with every kv head is the book's causal
    # multi-head attention without its (context_length x context_length) mask buffer.
    gqa = attnscope.GroupedQueryAttention(D_MODEL, D_MODEL, HEADS, HEADS, rope=False).eval()
    mha = None
    if config in ("fast", "explicit", "full-trace"):
        mha = attnscope.MultiHeadAttention(D_MODEL, D_MODEL, tokens, 0.0, HEADS).eval()

    def blocked():
        q, k, v = gqa._queries_keys_values(x, None, 0, None)
        ctx = AF.blocked_attention(q, k, v, causal=True, block=block)
        return gqa.out_proj(AF.merge_heads(ctx))

    calls = {
        "fast": lambda: mha(x),
        "fast-gqa": lambda: gqa(x),
        "explicit": lambda: mha._pipeline(x, None),
        "blocked": blocked,
        "full-trace": lambda: mha.trace(x),
        "row-trace": lambda: gqa.trace(x, rows=[0, tokens - 1], block=block),
    }
    fn = calls[config]
    before = _rss_kib("VmRSS")
    resettable = _reset_peak()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
        del result
    peak = _rss_kib("VmHWM")
    return {
        "config": config,
        "tokens": tokens,
        "seconds": best,
        "peak_mib": (peak - before) / 1024,
        "peak_reset": resettable,
    }


def measure(config: str, tokens: int, repeat: int, block: int) -> dict:
    cmd = [sys.executable, __file__, "--one", config, "--tokens", str(tokens)]
    cmd += ["--repeat", str(repeat), "--block", str(block)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"config": config, "tokens": tokens, "error": done.stderr.strip()[-300:]}
    return json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--long", type=int, default=16384, help="the long row trace's tokens")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--block", type=int, default=512)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.tokens, args.repeat, args.block)))
        return
    t = args.tokens
    rows = [measure(c, t, args.repeat, args.block) for c in ("fast", "explicit", "blocked")]
    rows += [measure(c, t, 1, args.block) for c in ("full-trace", "row-trace")]
    rows += [measure(c, args.long, 1, args.block) for c in ("fast-gqa", "row-trace")]
    print(f"d_model {D_MODEL}, {HEADS} heads, causal, batch 1, block {args.block}")
    print(f"{'config':<12} {'tokens':>7} {'seconds':>9} {'peak MiB':>9}")
    by = {}
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<12} {r['tokens']:>7}  failed: {r['error']}")
            continue
        by[(r["config"], r["tokens"])] = r
        print(f"{r['config']:<12} {r['tokens']:>7} {r['seconds']:>9.3f} {r['peak_mib']:>9.1f}")

    def ratio(a, b, key):
        if a in by and b in by and by[b][key] > 0:
            return f"{by[a][key] / by[b][key]:.2f}x"
        return "n/a"

    print()
    print(
        f"blocked / fast at {t}: time {ratio(('blocked', t), ('fast', t), 'seconds')}, "
        f"peak memory {ratio(('blocked', t), ('fast', t), 'peak_mib')}"
    )
    print(
        f"blocked / explicit at {t}: time {ratio(('blocked', t), ('explicit', t), 'seconds')}, "
        f"peak memory {ratio(('blocked', t), ('explicit', t), 'peak_mib')}"
    )
    print(
        f"row trace / full trace at {t}: time "
        f"{ratio(('row-trace', t), ('full-trace', t), 'seconds')}, peak memory "
        f"{ratio(('row-trace', t), ('full-trace', t), 'peak_mib')}"
    )
    long = args.long
    print(
        f"row trace / fast path at {long}: time "
        f"{ratio(('row-trace', long), ('fast-gqa', long), 'seconds')}"
    )
    print(
        f"row trace at {long} / at {t}: time "
        f"{ratio(('row-trace', long), ('row-trace', t), 'seconds')}, peak memory "
        f"{ratio(('row-trace', long), ('row-trace', t), 'peak_mib')} "
        f"(tokens x{long / t:g}; a full trace would need x{(long / t) ** 2:g} for its matrices)"
    )


if __name__ == "__main__":
    main()
