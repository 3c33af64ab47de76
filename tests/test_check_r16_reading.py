"""Readings that round 16's first run asked for: rotary layers run one sequence at a time
(llama.cpp's ubatches) or over one flattened batch (an inference engine's), windows declared
as ``(left, right)`` pairs or as llama.cpp's ``n_swa``, positions counted backwards, and a
layer that changes past a length the probe does not reach."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import check
from attnscope.errors import AttnScopeError


def _rotate(x, pos, base=10000.0, pairs="half"):
    """x ``(..., T, H, D)`` turned by the angles of positions ``pos`` ``(T,)``."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv  # (T, D/2)
    cos, sin = ang.cos().to(x.dtype)[:, None], ang.sin().to(x.dtype)[:, None]
    if pairs == "half":
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class _Hparams:
    n_swa = 0


class _RotaryLayer(nn.Module):
    """A grouped rotary layer (4 query heads over 2 kv heads), causal. ``run``: "batched",
    "per_sequence" (each sequence its own call, llama.cpp's ubatches) or "flattened" (every
    sequence's tokens, at their own positions, one sequence to a single causal call: the
    batch mixed). ``positions``: "up", "down" (n-1..0) or "negated" (0, -1, ..: turned by
    -theta). ``window`` (keys a query sees) applied where ``apply_window``; ``hp.n_swa`` and
    ``window_size`` declare one. ``logn``: queries scaled by
    log(position)/log(16) past 16 tokens (Qwen-1)."""

    def __init__(self, run="batched", positions="up", window=None, apply_window=True):
        super().__init__()
        torch.manual_seed(0)
        self.run, self.positions, self.logn = run, positions, False
        self.window, self.apply_window = window, apply_window
        self.hp = _Hparams()
        self.q = nn.Linear(32, 32, bias=False)
        self.k = nn.Linear(32, 16, bias=False)
        self.v = nn.Linear(32, 16, bias=False)
        self.o = nn.Linear(32, 32, bias=False)

    def _one(self, x, pos=None):  # x (T, 32) -> (T, 32)
        n = x.shape[0]
        pos = torch.arange(n) if pos is None else pos
        if self.positions == "down":
            pos = n - 1 - pos
        elif self.positions == "negated":  # a rotation by -theta (nanochat's convention)
            pos = -pos
        q = _rotate(self.q(x).view(n, 4, 8), pos)
        k = _rotate(self.k(x).view(n, 2, 8), pos)
        v = self.v(x).view(n, 2, 8)
        if self.logn and n > 16:
            scale = torch.log(torch.arange(1, n + 1, dtype=x.dtype)) / math.log(16)
            q = q * scale.clamp(min=1)[:, None, None]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        hide = j > i
        if self.window is not None and self.apply_window:
            hide = hide | (i - j >= self.window)
        s = s.masked_fill(hide, float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(0, 1).reshape(n, 32))

    def forward(self, x):
        if self.run == "flattened":
            b, n, d = x.shape
            # each sequence's own positions (the engine's), one causal call over them all
            return self._one(x.reshape(b * n, d), torch.arange(n).repeat(b)).view(b, n, -1)
        return torch.stack([self._one(seq) for seq in x])


def test_rotary_read_from_each_sequence_run_apart():
    """One rotation per sequence, none of the batch's: the operands of every sequence's
    core together (it had been refused as a rotation it could not read)."""
    report = check(lambda: _RotaryLayer(run="per_sequence"), kind="causal-multihead")
    assert outcome(report) == ("ok",), report.to_text(color=False)
    assert report.structure["rope"]["pairing"] == "half"


def test_rotary_read_through_a_flattened_batch_names_the_mixing():
    report = check(lambda: _RotaryLayer(run="flattened"), kind="causal-multihead")
    assert outcome(report) == ("scores", "batch_mixing"), report.to_text(color=False)


def test_positions_counted_backwards_are_rope_positions():
    """Every pair turning backwards with the position: read as the forward rotation, and the
    positions named (it had been taken as the layer's own, negative, frequencies)."""
    report = check(lambda: _RotaryLayer(positions="down"), kind="causal-multihead")
    assert outcome(report) == ("rotated_queries", "rope_positions"), report.to_text(color=False)


def test_a_rotation_by_minus_theta_from_position_zero_is_a_convention():
    """nanochat turns each pair by -theta: the same scores as +theta with the pair's halves
    exchanged, so not a mistake (only positions counted down from n-1 are)."""
    report = check(lambda: _RotaryLayer(positions="negated"), kind="causal-multihead")
    assert outcome(report) == ("ok",), report.to_text(color=False)


@pytest.mark.parametrize(
    ("declare", "window", "applied", "want"),
    [
        ("pair", 8, True, ("ok",)),
        ("pair", 8, False, ("masked_scores", "window_missing")),
        ("n_swa", 8, True, ("ok",)),
        ("n_swa", 9, True, ("masked_scores", "window_size")),
    ],
    ids=["pair-applied", "pair-dropped", "n_swa-applied", "n_swa-one-wider"],
)
def test_windows_declared_as_a_left_right_pair_or_n_swa(declare, window, applied, want):
    """``window_size = (7, 0)`` (flash-attn, TransformerEngine: 7 keys to the left, none to
    the right) declares 8 keys; llama.cpp's ``hparams.n_swa = 8`` too."""

    def make():
        layer = _RotaryLayer(window=window, apply_window=applied)
        if declare == "pair":
            layer.window_size = (7, 0)
        else:
            layer.hp.n_swa = 8
        return layer

    report = check(make, kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)


def test_a_left_right_pair_with_no_left_bound_declares_no_window():
    layer = _RotaryLayer()
    layer.window_size = (-1, 0)
    report = check(lambda: layer, kind="causal-multihead")
    assert outcome(report) == ("ok",) and report.structure["window"] is None


def test_a_layer_that_changes_past_the_probe_length_is_refused():
    """Queries scaled by log(position) past 16 tokens: plain attention at the probe's length,
    not at 40 tokens. Refused, never passed."""

    def make():
        layer = _RotaryLayer()
        layer.logn = True
        return layer

    with pytest.raises(AttnScopeError, match=r"log\(position\).*") as err:
        check(make, kind="causal-multihead")
    assert "not supported yet" in str(err.value)
