"""How long `attnscope check` takes on a GPT-2-small-sized layer (d 768, 12 heads, 128 tokens).

The issue's bar: under 3 seconds on the CPU beyond importing torch. Run:

    python benchmarks/bench_check.py [--repeats 5]

It imports torch and transformers first (not counted), builds Hugging Face GPT2Attention
layers from a config with random weights (no download), then times, in this process:
the first check (attnscope's import included) and the median of the next ones, for a
correct layer and for one with a bug (scale_attn_weights=False: missing_scale), which
makes the checker run its catalogue of mistakes.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    layers = {
        "correct": GPT2Attention(GPT2Config(n_embd=768, n_head=12, n_positions=1024), layer_idx=0),
        "missing_scale": GPT2Attention(
            GPT2Config(n_embd=768, n_head=12, n_positions=1024, scale_attn_weights=False),
            layer_idx=0,
        ),
    }
    start = time.perf_counter()
    from attnscope import check

    first = None
    rows = []
    for name, layer in layers.items():
        times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            report = check(layer, tokens=args.tokens)
            elapsed = time.perf_counter() - t0
            if first is None:
                first = time.perf_counter() - start
            if i:
                times.append(elapsed)
        verdict = "ok" if report.ok else report.first_failure.mistake
        rows.append((name, verdict, statistics.median(times), min(times), max(times)))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, tokens={args.tokens}")
    print(f"first check, attnscope import included: {first:.2f} s")
    print(f"{'layer':15s} {'verdict':15s} {'median s':>9s} {'min s':>7s} {'max s':>7s}")
    for name, verdict, med, lo, hi in rows:
        print(f"{name:15s} {verdict:15s} {med:9.3f} {lo:7.3f} {hi:7.3f}")


if __name__ == "__main__":
    main()
