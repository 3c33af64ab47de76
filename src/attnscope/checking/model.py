"""Check a whole model: every attention layer, on the inputs it really gets.

The model runs the way it is meant to (token ids within its vocabulary, or hidden states for a
stack of layers); one recorded run finds every attention layer by what it computes
(:func:`.structure.attention_layers`), in the order the model runs them. Each layer is then
checked by the single-layer checker where it sits: the model runs on its own input, the
layer's hidden states are swapped for the probe on the way in (its other arguments, masks and
position embeddings, are the ones the model makes), and only the layer's own computation is
recorded.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import AttnScopeError
from .probe import BATCH, ModuleProbe, first_tensor
from .record import Recorder
from .report import CheckReport, ModelReport
from .structure import attention_layers
from .target import Target, call_safely

__all__ = ["ModelHost", "check_model", "token_vocabulary"]


def token_vocabulary(model: nn.Module) -> int | None:
    """The vocabulary size of the model's first embedding table (None: it takes vectors)."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None


@dataclasses.dataclass
class ModelHost:
    """How to run the model around a layer: on token ids (``vocab``) or on vectors."""

    model: nn.Module
    path: str  # the layer's dotted module path
    vocab: int | None
    width: int | None  # the model's input width when it takes vectors
    timeout: float | None

    def call(self, x: torch.Tensor):
        """Run the model on ``x`` (ids or vectors): ``(output, None)`` or ``(None, error)``."""
        result, err = call_safely(self.model, x, timeout=self.timeout)
        return (None, err) if err is not None else (first_tensor(result), None)

    def input(self, b: int, n: int, gen: torch.Generator) -> torch.Tensor:
        if self.vocab is not None:
            return torch.randint(0, self.vocab, (b, n), generator=gen)
        return torch.randn(b, n, self.width, generator=gen)


def _model_width(model: nn.Module) -> int | None:
    for p in model.parameters():
        if p.dim() == 2:
            return p.shape[1]
    return None


def check_model(
    tgt: Target, seed: int, timeout: float | None, tokens: int | None, kind=None
) -> ModelReport:
    """Every attention layer of ``tgt.obj``, checked where it sits (see the module doc)."""
    model = tgt.obj
    model.eval()
    vocab = token_vocabulary(model)
    width = None if vocab is not None else _model_width(model)
    gen = torch.Generator().manual_seed(seed + 2)
    n = tokens or 7
    probe_host = ModelHost(model, "", vocab, width, timeout)
    x = probe_host.input(BATCH, n, gen)
    rec = Recorder({id(x): "input:0"}, model)
    with rec:
        out, err = probe_host.call(x)
    if err is not None:
        what = f"token ids below {vocab}" if vocab is not None else f"vectors of width {width}"
        raise AttnScopeError(f"{tgt.text}: the model raised on {what} {tuple(x.shape)}: {err}")
    paths = attention_layers(rec, model)
    if not paths:
        raise AttnScopeError(f"{tgt.text}: found no attention layer in the model's computation")
    reports: list[tuple[str, CheckReport]] = []
    for path in paths:
        layer = model.get_submodule(path)
        host = ModelHost(model, path, vocab, width, timeout)
        sub = Target(layer, f"{tgt.text} {path}", "instance")
        report = ModuleProbe(sub, kind, seed, timeout, None, tokens, host=host).run()
        reports.append((path, report))
    report = ModelReport.of(tgt.text, reports)
    report.notes = list(tgt.notes)
    return report
