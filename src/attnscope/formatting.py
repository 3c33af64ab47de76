"""Numbers as one-line text, for messages anywhere in the package.

Below everything that reports: the demo's checks, the checker's messages and the renderers
all say values the same way, without any of them importing another.
"""

from __future__ import annotations

import torch

__all__ = ["EDGE_VALUES", "format_number", "format_values"]

#: :func:`format_values` shows this many values at each end of a longer vector.
EDGE_VALUES = 4


def format_number(v: float) -> str:
    """One value to 4 decimals."""
    return f"{v:.4f}"


def format_values(t: torch.Tensor, *, edge: int = EDGE_VALUES) -> str:
    """Values to 4 decimals on one line; a long one shows its first and last ``edge``.

    ``0.1000 0.2000 ... 0.9000 1.0000 (128 values)``: for one-line messages, where a
    vector of any length must stay readable.
    """
    values = t.detach().flatten().tolist()
    if len(values) <= 2 * edge + 1:
        return " ".join(format_number(v) for v in values)
    head = " ".join(format_number(v) for v in values[:edge])
    tail = " ".join(format_number(v) for v in values[-edge:])
    return f"{head} ... {tail} ({len(values)} values)"
