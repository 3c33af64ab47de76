"""How long `attnscope check` takes on a whole GPT-2-small-sized model (12 layers, d 768,
12 heads, 128 tokens): every attention layer checked where it sits. Not a test; run:

    python benchmarks/bench_model.py [--repeats 3] [--layers 12] [--tokens 128]

It builds Hugging Face's GPT2Model from a config with random weights (no download), imports
first (not counted), then times whole-model checks (every layer, and cached decoding against
the full pass) and reports the median, the time per layer, and the model's own forward pass
for scale. Issue #10's bar: 10 s.
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    from transformers import GPT2Config, GPT2Model
    from transformers.utils import logging

    from attnscope import check

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=768, n_head=12, n_layer=args.layers, n_positions=1024)
    model = GPT2Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, args.tokens))
    with torch.no_grad():
        start = time.perf_counter()
        model(ids)
        forward = time.perf_counter() - start
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        report = check(lambda: model, tokens=args.tokens)
        runs.append(time.perf_counter() - start)
    med = statistics.median(runs)
    print(
        f"GPT2Model, {args.layers} layers, d 768, 12 heads, {args.tokens} tokens: check median "
        f"{med:.2f} s (runs {', '.join(f'{r:.2f}' for r in runs)}), {med / args.layers:.2f} s "
        f"per layer; one forward pass of the model on 2 x {args.tokens} tokens: "
        f"{forward * 1e3:.0f} ms; ok={report.ok}, layers={len(report.layers)}"
    )


if __name__ == "__main__":
    main()
