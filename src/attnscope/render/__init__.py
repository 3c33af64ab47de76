"""Rendering: text (rich), HTML, figures (matplotlib). Rendering never computes attention."""

from __future__ import annotations

from pathlib import Path

from ..errors import AttnScopeError

__all__ = ["write_output"]


def write_output(path: str | Path, data: str | bytes, *, overwrite: bool = False) -> Path:
    """Write a report or figure to ``path``, refusing to replace an existing file.

    Nothing a user has is overwritten without asking: pass ``overwrite=True`` (the CLI's
    ``--force``) to replace it.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise AttnScopeError(
            f"{path}: expected a new file, got an existing one; choose another name or pass "
            "--force (overwrite=True) to replace it"
        )
    if not path.parent.is_dir():
        raise AttnScopeError(f"{path}: expected an existing folder {path.parent}, got none")
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path
