"""Regenerate the pictures and reports in docs/ with the commands the README documents.

    python docs/make_images.py

heatmap.png               attnscope plot --kind self --seed 123 --highlight 1,1
heatmap-causal-heads.png  attnscope plot --kind causal-multihead --d-out 4 --heads 2
                          --stage masked_scores
pipeline.png              attnscope plot --pipeline
trace-report.html         attnscope trace --html
check-report.html         attnscope check examples/gallery/buggy/mha_scale_by_d_out.py:...
                          --html   (check-report.png is a headless-Chromium screenshot of it)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from attnscope.cli import main

HERE = Path(__file__).resolve().parent
GALLERY = HERE.parent / "examples" / "gallery"


def run(*argv: str) -> int:
    code = main(list(argv))
    print(f"attnscope {' '.join(argv)}  -> exit {code}")
    return code


def screenshot(page: str, png: str) -> None:
    """The top of an HTML report as a PNG, with headless Chromium where it is installed."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print(f"{png}: skipped (no chromium installed)")
        return
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--hide-scrollbars",
            f"--screenshot={Path(png).resolve()}",
            "--window-size=1200,1500",
            Path(page).resolve().as_uri(),
        ],
        check=True,
        capture_output=True,
    )
    print(f"wrote {png}")


if __name__ == "__main__":
    os.chdir(HERE.parent)  # paths in the check report are shown relative to the repo
    run(
        "plot",
        "--kind",
        "self",
        "--seed",
        "123",
        "--highlight",
        "1,1",
        "-o",
        "docs/heatmap.png",
        "--force",
    )
    run(
        "plot",
        "--kind",
        "causal-multihead",
        "--seed",
        "123",
        "--d-out",
        "4",
        "--heads",
        "2",
        "--stage",
        "masked_scores",
        "-o",
        "docs/heatmap-causal-heads.png",
        "--force",
    )
    run("plot", "--pipeline", "-o", "docs/pipeline.png", "--force")
    run("trace", "--html", "docs/trace-report.html", "--force")
    run(
        "check",
        "examples/gallery/buggy/mha_scale_by_d_out.py:MultiHeadAttention",
        "--html",
        "docs/check-report.html",
        "--force",
    )
    screenshot("docs/check-report.html", "docs/check-report.png")
