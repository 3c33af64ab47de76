"""Helpers for users' own pytest suites.

>>> from attnscope.testing import assert_attention
>>> def test_my_attention():
...     assert_attention("mypkg.layers:CausalSelfAttention", kind="causal")
"""

from __future__ import annotations

from .checking import CheckReport, check

__all__ = ["assert_attention", "AttentionMismatch"]


class AttentionMismatch(AssertionError):
    """Raised by :func:`assert_attention`; ``report`` holds the full :class:`CheckReport`."""

    def __init__(self, report: CheckReport):
        super().__init__(report.to_text(color=False))
        self.report = report


def assert_attention(target: str | object, kind: str | None = None, **options) -> CheckReport:
    """Fail the calling test, with the check report's text, unless ``target`` is correct.

    Takes what :func:`attnscope.check` takes (``kind``, ``init``, ``seed``, ``timeout``,
    ``weights``, ``tokens``) and returns the report when every stage matches; a whole
    model passes when every attention layer does. A target that cannot be checked at all
    raises :class:`attnscope.AttnScopeError`.
    """
    report = check(target, kind=kind, **options)
    if not report.ok:
        raise AttentionMismatch(report)
    return report
