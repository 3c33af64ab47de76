"""A predict-then-check walk as data: what :mod:`attnscope.demo` builds and renderers draw.

A :class:`Step` says what to predict, then holds the predicted and actual shapes, the
tensors to show and the checks that ran; a :class:`DemoResult` is the steps of a whole walk
with the trace of each part. Nothing here computes or prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .trace import ShapeCheck, Trace

__all__ = ["Check", "DemoResult", "Shown", "Step"]


@dataclass(frozen=True)
class Check:
    """One named check with its outcome and a sentence saying what was compared."""

    name: str
    ok: bool
    detail: str

    def as_tuple(self) -> tuple[str, bool, str]:
        return (self.name, self.ok, self.detail)


@dataclass(frozen=True)
class Shown:
    """A tensor to print, with optional row and column labels."""

    name: str
    tensor: torch.Tensor
    rows: tuple[str, ...] | None = None
    cols: tuple[str, ...] | None = None


@dataclass
class Step:
    """One step of the walk: what to predict, then the shapes, values and checks."""

    part: str
    title: str
    predict: str
    shapes: list[ShapeCheck] = field(default_factory=list)
    shown: list[Shown] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.shapes) and all(c.ok for c in self.checks)


@dataclass
class DemoResult:
    """The whole walk: its steps in order and the trace of every part walked."""

    steps: list[Step]
    traces: dict[str, Trace]
    token: int
    book: bool

    @property
    def checks(self) -> list[Check]:
        """Every check, shape agreements included, in the order they ran."""
        out = []
        for step in self.steps:
            out += [
                Check(f"{s.name} shape", s.ok, f"predicted {s.predicted}, got {s.actual}")
                for s in step.shapes
            ]
            out += step.checks
        return out

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def main_trace(self) -> Trace:
        """The trace of the last part walked (the one an HTML report shows)."""
        return list(self.traces.values())[-1]
