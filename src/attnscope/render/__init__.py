"""Rendering: text (rich), HTML, figures (matplotlib). Rendering never computes attention.

Each renderer registers itself with :mod:`attnscope.display` for the data it draws, so that
``trace.to_html()`` or ``report.to_text()`` find it without the data importing this package.
Importing this package (``import attnscope`` does) fills that table.
"""

from __future__ import annotations

from . import figures, html, text  # noqa: F401  (registration)
from .files import claim_output, write_output

__all__ = ["claim_output", "write_output"]
