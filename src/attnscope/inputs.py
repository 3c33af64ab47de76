"""Embeddings and token labels from files, for the CLI's ``--input`` and ``--labels``.

Supported files (one row per token):

- ``.pt``: a tensor ``(tokens, d_in)`` or ``(batch, tokens, d_in)``, or a dict with
  ``"embeddings"`` (that tensor) and optional ``"labels"`` (one string per token). Read with
  ``torch.load(weights_only=True)``: no code in the file runs.
- ``.npy``: an array of numbers, read with ``allow_pickle=False``.
- ``.csv``: comma-separated numbers, one token per line. A first column that is not numeric
  on every line is the token labels; a first line whose number columns are not numbers is
  a header and is skipped. A first line whose first cell is empty (pandas' ``to_csv()``
  with its index: ``,0,1,2``) is a header too, and the first column (the index) is the
  labels. Lines starting with ``#`` and blank lines are ignored.

  A header of numbers cannot be told from a token: pandas' ``to_csv(index=False)`` of a
  frame with the default column names writes ``0,1,2`` first, which is read as one more
  token. Write such files with ``header=False`` (or delete that line).

Everything is returned as float32 (the modules' dtype); every problem is one
:class:`~attnscope.AttnScopeError` that names the file.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import AttnScopeError, check_labels, describe

__all__ = ["Embeddings", "load_embeddings", "parse_labels", "read_labels_file", "resolve_labels"]

SUFFIXES = (".pt", ".npy", ".csv")


@dataclass(frozen=True)
class Embeddings:
    """Embeddings read from a file.

    Attributes:
        tensor: ``(tokens, d_in)`` or ``(batch, tokens, d_in)`` float32.
        labels: one label per token when the file had them, else ``None``.
        source: the file it came from.
    """

    tensor: torch.Tensor
    labels: tuple[str, ...] | None
    source: Path

    @property
    def tokens(self) -> int:
        return self.tensor.shape[-2]


def load_embeddings(path: str | Path, *, ranks: tuple[int, ...] = (2, 3)) -> Embeddings:
    """Read embeddings from a ``.pt``, ``.npy`` or ``.csv`` file (see the module docstring).

    Args:
        path: the file.
        ranks: the tensor ranks accepted: 2 is ``(tokens, d_in)``, 3 is ``(batch, tokens, d_in)``.

    Returns:
        :class:`Embeddings` with a float32 tensor.
    """
    path = Path(path)
    if not path.exists():
        raise AttnScopeError(f"{path}: expected an embeddings file, got no such file")
    if not path.is_file():
        raise AttnScopeError(f"{path}: expected an embeddings file, got a folder")
    suffix = path.suffix.lower()
    if suffix == ".pt":
        data, labels = _read_pt(path)
    elif suffix == ".npy":
        data, labels = _read_npy(path), None
    elif suffix == ".csv":
        data, labels = _read_csv(path)
    else:
        raise AttnScopeError(
            f"{path}: expected a file ending in {', '.join(SUFFIXES)}, "
            f"got {path.suffix or 'none'!r}"
        )
    tensor = _validate(data, path, ranks)
    if labels is not None:
        labels = check_labels(labels, tensor.shape[-2], name=f"{path} labels")
    return Embeddings(tensor, labels, path)


def _read_pt(path: Path) -> tuple[object, object]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and unsafe-global errors all mean "cannot read"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AttnScopeError(
            f"{path}: expected a file saved with torch.save, could not read it ({reason[:200]})"
        ) from None
    if isinstance(obj, dict):
        if "embeddings" not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
            raise AttnScopeError(
                f"{path}: expected a tensor or a dict with an 'embeddings' key, got a dict with "
                f"keys {keys}"
            )
        data, labels = obj["embeddings"], obj.get("labels")
    else:
        data, labels = obj, None
    if not isinstance(data, torch.Tensor):
        raise AttnScopeError(
            f"{path}: expected a tensor or a dict with an 'embeddings' tensor, got {describe(data)}"
        )
    return data, labels


def _read_npy(path: Path) -> np.ndarray:
    with path.open("rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":  # else np.load would try to unpickle it
        raise AttnScopeError(f"{path}: expected a .npy array (np.save), could not read it")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "pickle" in str(exc):
            raise AttnScopeError(
                f"{path}: expected an array of numbers, got an array of Python objects"
            ) from None
        raise AttnScopeError(f"{path}: expected a .npy array, could not read it ({exc})") from None
    except Exception as exc:
        raise AttnScopeError(f"{path}: expected a .npy array, could not read it ({exc})") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_csv(path: Path) -> tuple[list[list[float]], list[str] | None]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise AttnScopeError(f"{path}: expected a UTF-8 text file of numbers, got binary") from None
    rows: list[tuple[int, list[str]]] = []
    for lineno, fields in enumerate(csv.reader(text.splitlines()), start=1):
        fields = [f.strip() for f in fields]
        if not fields or all(f == "" for f in fields) or fields[0].startswith("#"):
            continue
        rows.append((lineno, fields))
    if not rows:
        raise AttnScopeError(f"{path}: expected at least one token (a line of numbers), got none")

    if rows[0][1][0] == "" and len(rows) > 1:
        # pandas' to_csv() with its index: ",0,1,2" names the columns, the index labels rows.
        rows, has_labels = rows[1:], True
    else:
        # Labels: a first column that is non-numeric on every line (the header included).
        has_labels = all(not _is_number(fields[0]) for _, fields in rows)
        first_values = rows[0][1][1 if has_labels else 0 :]
        if first_values and not any(_is_number(f) for f in first_values) and len(rows) > 1:
            rows = rows[1:]  # a header line: column names, not numbers
    start = 1 if has_labels else 0

    width = len(rows[0][1])
    values: list[list[float]] = []
    labels: list[str] = []
    for lineno, fields in rows:
        if len(fields) != width:
            raise AttnScopeError(
                f"{path}, line {lineno}: expected {width} comma-separated fields like the first "
                f"line, got {len(fields)}"
            )
        if has_labels:
            labels.append(fields[0])
        row = []
        for col, field in enumerate(fields[start:], start=start + 1):
            try:
                number = float(field)
            except ValueError:
                raise AttnScopeError(
                    f"{path}, line {lineno}, column {col}: expected a number, got {field!r}"
                ) from None
            if not math.isfinite(number):
                raise AttnScopeError(
                    f"{path}, line {lineno}, column {col}: expected a finite number, got {field!r}"
                )
            row.append(number)
        if not row:
            raise AttnScopeError(
                f"{path}, line {lineno}: expected numbers after the label, got none"
            )
        values.append(row)
    return values, (labels if has_labels else None)


def _validate(data: object, path: Path, ranks: tuple[int, ...]) -> torch.Tensor:
    """Turn ``data`` into a finite float32 tensor of an allowed rank, or say what is wrong."""
    if isinstance(data, np.ndarray):
        if data.dtype.kind not in "iuf":  # ints, unsigned, floats; not bool/complex/str/object
            raise AttnScopeError(f"{path}: expected an array of numbers, got dtype {data.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(data))
    elif isinstance(data, torch.Tensor):
        if data.dtype == torch.bool or data.is_complex():
            raise AttnScopeError(f"{path}: expected a tensor of real numbers, got {describe(data)}")
        tensor = data
    elif isinstance(data, list):  # from CSV
        tensor = torch.tensor(data, dtype=torch.float64)
    else:
        raise AttnScopeError(f"{path}: expected a tensor of embeddings, got {describe(data)}")
    if tensor.dim() not in ranks:
        layouts = {2: "(tokens, d_in)", 3: "(batch, tokens, d_in)"}
        want = " or ".join(layouts.get(r, f"rank {r}") for r in ranks)
        raise AttnScopeError(
            f"{path}: expected shape {want}, got shape {tuple(tensor.shape)} (rank {tensor.dim()})"
        )
    if tensor.shape[-2] == 0:
        raise AttnScopeError(
            f"{path}: expected at least one token, got shape {tuple(tensor.shape)}"
        )
    if tensor.numel() == 0:
        raise AttnScopeError(
            f"{path}: expected at least one feature per token, got shape {tuple(tensor.shape)}"
        )
    tensor = tensor.detach().to(device="cpu", dtype=torch.float32)
    if not torch.isfinite(tensor).all():
        bad = (~torch.isfinite(tensor)).sum().item()
        raise AttnScopeError(
            f"{path}: expected finite numbers, got {bad} NaN or inf entries "
            "(or numbers too large for float32)"
        )
    return tensor.contiguous()


def parse_labels(text: str) -> tuple[str, ...]:
    """Labels from ``"a,b,c"`` (the CLI's ``--labels``); surrounding spaces are dropped."""
    return check_labels([part.strip() for part in text.split(",")], None, name="--labels")


def read_labels_file(path: str | Path) -> tuple[str, ...]:
    """Labels from a text file, one per line (trailing blank lines are ignored)."""
    path = Path(path)
    if not path.exists():
        raise AttnScopeError(f"{path}: expected a labels file, got no such file")
    if not path.is_file():
        raise AttnScopeError(f"{path}: expected a labels file, got a folder")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise AttnScopeError(f"{path}: expected a UTF-8 text file, got binary") from None
    while lines and not lines[-1].strip():
        lines.pop()
    return check_labels([line.strip() for line in lines], None, name=str(path))


def resolve_labels(
    given: tuple[str, ...] | None, from_file: tuple[str, ...] | None, tokens: int, default=None
) -> tuple[str, ...]:
    """The labels to use: the user's ``--labels`` first, then the file's, then ``default``.

    Falls back to ``"0"``, ``"1"``, ... when none is given.
    """
    for labels, where in ((given, "--labels"), (from_file, "embeddings file labels")):
        if labels is not None:
            return check_labels(labels, tokens, name=where)
    if default is not None and len(default) == tokens:
        return tuple(default)
    return tuple(str(i) for i in range(tokens))
