"""User-facing errors and the input checks that raise them.

Every bad input is rejected with one :class:`AttnScopeError` whose message names what
was expected and what was given. The CLI prints that message and exits with code 2;
the library raises it (it is a ``ValueError``, so ``except ValueError`` still works).
"""

from __future__ import annotations

import torch

__all__ = [
    "AttnScopeError",
    "SEED_MIN",
    "SEED_MAX",
    "check_embeddings",
    "check_labels",
    "check_seed",
    "check_tensor",
    "check_token_index",
    "describe",
]

#: The seeds ``torch.manual_seed`` accepts (inclusive): a wider one raises inside torch.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class AttnScopeError(ValueError):
    """A user error: the message says what was expected and what was given."""


def describe(obj: object) -> str:
    """A short description of ``obj`` for error messages: ``tensor of shape (2, 3), float32``."""
    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        return f"tensor of shape {tuple(obj.shape)}, {dtype}"
    if isinstance(obj, dict):
        return f"dict with keys {list(obj)[:8]}"
    if isinstance(obj, (tuple, list)):
        return (
            f"{type(obj).__name__} of {len(obj)} ({', '.join(type(v).__name__ for v in obj[:4])})"
        )
    return f"{type(obj).__name__} {obj!r}"[:120]


def check_tensor(
    x: object, *, name: str, ranks: tuple[int, ...], finite: bool = True
) -> torch.Tensor:
    """Validate a floating-point, non-empty tensor of one of ``ranks`` (finite unless told)."""
    return check_embeddings(x, name=name, ranks=ranks, finite=finite)


def check_embeddings(
    x: object,
    *,
    name: str = "x",
    d_in: int | None = None,
    ranks: tuple[int, ...] = (2, 3),
    max_tokens: int | None = None,
    finite: bool = True,
) -> torch.Tensor:
    """Validate an embeddings tensor and return it unchanged.

    Expected: a floating-point ``torch.Tensor`` of shape ``(tokens, d_in)`` or
    ``(batch, tokens, d_in)`` (``ranks`` says which ranks are allowed), with at least one
    token, finite values, ``d_in`` features when given, and at most ``max_tokens`` tokens.
    """
    if not isinstance(x, torch.Tensor):
        raise AttnScopeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    if x.dim() not in ranks:
        layouts = {1: "(d,)", 2: "(tokens, d_in)", 3: "(batch, tokens, d_in)"}
        want = " or ".join(layouts.get(r, f"rank {r}") for r in ranks)
        raise AttnScopeError(f"{name}: expected shape {want}, got {describe(x)}")
    if not x.is_floating_point():
        raise AttnScopeError(
            f"{name}: expected a floating-point tensor (float32, float64, ...), got {describe(x)}; "
            "convert it with .float()"
        )
    if x.dim() >= 2 and x.shape[-2] == 0:
        raise AttnScopeError(f"{name}: expected at least one token, got {describe(x)}")
    if x.numel() == 0:
        raise AttnScopeError(f"{name}: expected a non-empty tensor, got {describe(x)}")
    if d_in is not None and x.shape[-1] != d_in:
        raise AttnScopeError(
            f"{name}: expected {d_in} features in the last dimension (d_in={d_in}), "
            f"got {describe(x)}"
        )
    if max_tokens is not None and x.dim() >= 2 and x.shape[-2] > max_tokens:
        raise AttnScopeError(
            f"{name}: expected at most context_length={max_tokens} tokens, "
            f"got {x.shape[-2]} ({describe(x)})"
        )
    if finite and not _all_finite(x):
        bad = (~torch.isfinite(x)).sum().item()
        raise AttnScopeError(
            f"{name}: expected finite values, got {bad} NaN or inf entries in {describe(x)}"
        )
    return x


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every entry is finite, at the cost of one sum in the usual case.

    Any NaN or inf entry makes the sum NaN or inf, so a finite sum proves them all finite;
    a non-finite sum (possibly just overflow of large finite values) is checked entry by
    entry. ``isfinite(x).all()`` alone costs about 5% of a long multi-head forward pass.
    """
    if torch.isfinite(x.detach().sum()):
        return True
    return bool(torch.isfinite(x).all())


def check_token_index(
    index: object,
    tokens: int,
    *,
    name: str = "query token",
    noun: str = "tokens",
    negative: bool = True,
) -> int:
    """Validate a position in ``[-tokens, tokens)`` and return it as a non-negative int.

    Negative positions count from the end, as in Python (``-1`` is the last), unless
    ``negative=False`` (the CLI's options count from 0 only). ``noun`` names what is
    counted in the message: ``tokens``, or ``sequences`` for a batch index.
    """
    if isinstance(index, bool) or not isinstance(index, int):
        raise AttnScopeError(f"{name}: expected an integer position, got {describe(index)}")
    low = -tokens if negative else 0
    if not low <= index < tokens:
        from_end = f"or -{tokens} to -1 counting from the end; " if negative else ""
        raise AttnScopeError(
            f"{name}: expected a position from 0 to {tokens - 1} ({from_end}the input has "
            f"{tokens} {noun}), got {index}"
        )
    return index % tokens


def check_labels(labels: object, tokens: int | None, *, name: str = "labels") -> tuple[str, ...]:
    """Validate token labels and return them as a tuple of strings.

    Expected: a list or tuple (or a 1-D tensor or array) with one non-empty label per
    token; each label is turned into text with ``str`` (so ``[1, 2, 3]`` is fine).
    ``tokens=None`` skips the count (labels read before the embeddings).
    """
    if hasattr(labels, "tolist") and not isinstance(labels, (str, bytes)):
        labels = labels.tolist()  # a tensor or array of labels: its numbers, not its repr
    if isinstance(labels, (str, bytes)) or not isinstance(labels, (list, tuple)):
        raise AttnScopeError(f"{name}: expected a list of labels, got {describe(labels)}")
    if not labels:
        raise AttnScopeError(f"{name}: expected one label per token, got none")
    text = tuple(str(label) for label in labels)
    for i, label in enumerate(text):
        if not label.strip():
            raise AttnScopeError(f"{name}: expected a non-empty label at position {i}, got ''")
    if tokens is not None and len(text) != tokens:
        raise AttnScopeError(f"{name}: expected {tokens} labels (one per token), got {len(text)}")
    return text


def check_seed(seed: object, *, name: str = "seed") -> int:
    """Validate a seed for ``torch.manual_seed``: an integer from -2**63 to 2**64 - 1."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise AttnScopeError(f"{name}: expected an integer, got {describe(seed)}")
    if not SEED_MIN <= seed <= SEED_MAX:
        raise AttnScopeError(
            f"{name}: expected an integer from -2**63 to 2**64 - 1 (what torch.manual_seed "
            f"accepts), got {seed}"
        )
    return seed
