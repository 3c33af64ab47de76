"""Regenerate the pictures in docs/ from the API: ``python docs/make_images.py``.

heatmap.png    the book's SelfAttentionV1 weights (seed 123), the seed's cell (1, 1) outlined
pipeline.png   the pipeline diagram of the same trace, with its real shapes and values
trace-report.html  the self-contained HTML report of that trace
"""

from __future__ import annotations

from pathlib import Path

import torch

import attnscope

HERE = Path(__file__).resolve().parent


def main() -> None:
    torch.manual_seed(123)  # the book's seed: its printed numbers
    module = attnscope.SelfAttentionV1(d_in=3, d_out=2)
    trace = attnscope.trace(module, attnscope.book_embeddings(), labels=attnscope.BOOK_TOKENS)
    trace.plot("weights", HERE / "heatmap.png", highlight=(1, 1), overwrite=True)
    trace.pipeline_figure(HERE / "pipeline.png", overwrite=True)
    from attnscope.render.html import trace_html

    trace_html(trace, HERE / "trace-report.html", overwrite=True)
    for name in ("heatmap.png", "pipeline.png", "trace-report.html"):
        print(HERE / name)


if __name__ == "__main__":
    main()
