"""Where reports and figures go: nothing a user has is overwritten without asking."""

from __future__ import annotations

from pathlib import Path

from ..errors import AttnScopeError

__all__ = ["claim_output", "write_output"]


def claim_output(path: str | Path, *, overwrite: bool = False) -> Path:
    """Check, before any work, that a report or figure may be written to ``path``.

    Nothing a user has is overwritten without asking: an existing file needs
    ``overwrite=True`` (the CLI's ``--force``).
    """
    path = Path(path)
    if path.is_dir():
        raise AttnScopeError(f"{path}: expected a file name, got a folder")
    if path.exists() and not overwrite:
        raise AttnScopeError(
            f"{path}: expected a new file, got an existing one; choose another name or pass "
            "--force (overwrite=True) to replace it"
        )
    if not path.parent.is_dir():
        raise AttnScopeError(f"{path}: expected an existing folder {path.parent}, got none")
    return path


def write_output(path: str | Path, data: str | bytes, *, overwrite: bool = False) -> Path:
    """Write a report or figure to ``path`` (see :func:`claim_output`)."""
    path = claim_output(path, overwrite=overwrite)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path
