"""The check report: what `attnscope check` found, as an object, text, JSON and HTML."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ..display import Rendered
from ..stages import Stage

__all__ = ["CheckReport", "Failure", "ModelReport", "StageCheck", "single_head"]


def single_head(head_dim: int, causal: bool = False) -> dict:
    """The ``structure`` of attention with one head and no trainable projections of heads."""
    return {"heads": 1, "kv_heads": 1, "head_dim": head_dim, "causal": causal, "cross": False}


@dataclass
class StageCheck:
    """One checkpoint: a stage of the user's computation against the reference.

    Attributes:
        stage: the stage checked.
        ok: whether it matches the reference (in an equivalent form).
        detail: one sentence: what was compared and found.
        predicted: the shape the stage's rule predicts for the probe input.
        actual: the shape of the user's tensor, when it was seen.
        location: ``file:line`` of the user's code that made that tensor, when known.
        reference: the reference tensor (probe sequence 0, float64), for side-by-side display.
        observed: the user's tensor at this stage in the reference layout, when seen.
    """

    stage: Stage
    ok: bool
    detail: str
    predicted: tuple[int, ...] | None = None
    actual: tuple[int, ...] | None = None
    location: str | None = None
    reference: torch.Tensor | None = field(default=None, repr=False)
    observed: torch.Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {"stage": self.stage.value, "ok": self.ok, "detail": self.detail}


@dataclass
class Failure:
    """The first stage that diverges, the mistake code and a message saying where to look."""

    stage: Stage
    mistake: str
    message: str
    location: str | None = None

    def to_dict(self) -> dict:
        return {"stage": self.stage.value, "mistake": self.mistake, "message": self.message}


@dataclass
class CheckReport(Rendered):
    """The result of checking one implementation against the reference pipeline.

    ``checks`` runs in pipeline order and stops at the first failing stage, as the seed's
    checklist does. ``to_dict()`` is the JSON contract of ``attnscope check --json``;
    ``to_text()``, ``to_html(path)`` and ``str()`` draw it (see :mod:`attnscope.render`).
    """

    ok: bool
    kind: str
    target: str
    first_failure: Failure | None
    checks: list[StageCheck]
    kind_reason: str = ""
    notes: list[str] = field(default_factory=list)
    #: what the checker read from the computation: heads, kv_heads, head_dim, causal, cross
    structure: dict | None = None
    #: the dotted module path of the attention layer checked, when the target wraps it
    layer: str | None = None

    def to_dict(self) -> dict:
        out = {
            "ok": self.ok,
            "kind": self.kind,
            "target": self.target,
            "first_failure": None if self.first_failure is None else self.first_failure.to_dict(),
            "checks": [c.to_dict() for c in self.checks],
        }
        if self.structure is not None:
            out["structure"] = self.structure
        if self.layer is not None:
            out["layer"] = self.layer
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


@dataclass
class ModelReport(Rendered):
    """A whole model, checked layer by layer in the order it runs them: each layer's
    :class:`CheckReport`, and the first failing layer's failure (``layer`` set).
    ``to_dict()`` is the contract's model report."""

    ok: bool
    target: str
    layers: list[tuple[str, CheckReport]]
    first_failure: Failure | None = None
    first_layer: str | None = None
    notes: list[str] = field(default_factory=list)
    #: cached decoding against the full pass (:class:`.decode.Decode`), where the model has
    #: a cache the checker drives
    decode: object | None = None

    kind = "model"

    @classmethod
    def of(cls, target: str, layers: list[tuple[str, CheckReport]], decode=None) -> ModelReport:
        failing = next(((p, r) for p, r in layers if not r.ok), None)
        return cls(
            ok=failing is None and (decode is None or decode.ok),
            decode=decode,
            target=target,
            layers=layers,
            first_failure=None if failing is None else failing[1].first_failure,
            first_layer=None if failing is None else failing[0],
        )

    def to_dict(self) -> dict:
        first = None
        if self.first_failure is not None:
            first = {**self.first_failure.to_dict(), "layer": self.first_layer}
        return {
            "ok": self.ok,
            "kind": "model",
            "target": self.target,
            "first_failure": first,
            "layers": [
                {
                    "layer": path,
                    "ok": r.ok,
                    "kind": r.kind,
                    **({"structure": r.structure} if r.structure is not None else {}),
                    "first_failure": None if r.first_failure is None else r.first_failure.to_dict(),
                    "checks": [c.to_dict() for c in r.checks],
                }
                for path, r in self.layers
            ],
            "decode": None if self.decode is None else self.decode.to_dict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)
