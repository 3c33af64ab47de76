"""Readings asked for by the open cases and the rounds of the session that wrote round 22:
an engine's flattened batch ``(batch * tokens, features)`` found stage by stage, and one
side's positions scaled against the other's read at a large rotary base."""

from __future__ import annotations

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import check


def _rotate(x, pos, base):
    """Halves pairing; ``x`` ``(..., tokens, hd)``, ``pos`` ``(tokens,)``."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class _FlatAttention(nn.Module):
    """An inference engine's layer: every sequence's tokens in one run of rows
    ``(sum(lens), d)``, positions restarting per sequence, grouped heads 4/2, base 1e6;
    ``doubled`` rotates the queries at twice their positions (the positions added twice)."""

    def __init__(self, doubled=False):
        super().__init__()
        self.doubled = doubled
        self.qkv = nn.Linear(32, 64, bias=True)
        self.o = nn.Linear(32, 32, bias=False)

    def forward(self, positions, x, lens):
        q, k, v = self.qkv(x).split([32, 16, 16], dim=-1)
        n = x.shape[0]
        q_pos = positions * 2 if self.doubled else positions
        q = _rotate(q.view(n, 4, 8).transpose(0, 1), q_pos, 1e6).transpose(0, 1)
        k = _rotate(k.view(n, 2, 8).transpose(0, 1), positions, 1e6).transpose(0, 1)
        v = v.view(n, 2, 8)
        outs, start = [], 0
        for length in lens:
            qs = q[start : start + length].transpose(0, 1)
            ks = k[start : start + length].transpose(0, 1).repeat_interleave(2, 0)
            vs = v[start : start + length].transpose(0, 1).repeat_interleave(2, 0)
            s = qs @ ks.transpose(-1, -2) * 8**-0.5
            hide = torch.ones(length, length, dtype=torch.bool).triu(1)
            w = s.masked_fill(hide, float("-inf")).softmax(-1)
            outs.append((w @ vs).transpose(0, 1).reshape(length, 32))
            start += length
        return self.o(torch.cat(outs))


class _FlatModel(nn.Module):
    def __init__(self, bug_in=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(96, 32)
        self.layers = nn.ModuleList(_FlatAttention(i == bug_in) for i in range(3))
        self.head = nn.Linear(32, 96)

    def forward(self, ids):
        b, n = ids.shape
        x = self.embed(ids).reshape(b * n, 32)
        positions = torch.arange(n).repeat(b)
        for layer in self.layers:
            x = x + layer(positions, x, [n] * b)
        return self.head(x).view(b, n, -1)


def test_a_flattened_batch_is_found_stage_by_stage_and_doubled_query_positions_named():
    """The queries of a flattened layer are rows of ``(batch * tokens, heads * hd)``; the
    stages are found in that layout, and queries turned at twice the keys' positions at
    base 1e6 are rope_positions at rotated_queries, in the layer that does it."""
    good = check(_FlatModel())
    assert good.ok, good.to_text(color=False)
    report = check(lambda: _FlatModel(bug_in=1))
    assert report.first_layer == "layers.1"
    assert outcome(report) == ("rotated_queries", "rope_positions"), report.to_text(color=False)
    assert "positions times 2" in report.first_failure.message


class _ScaledQueries(nn.Module):
    def __init__(self, base, factor):
        super().__init__()
        torch.manual_seed(1)
        self.base, self.factor = base, factor
        self.q, self.k, self.v = (nn.Linear(32, 32) for _ in range(3))
        self.o = nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, 4, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(n)
        q, k = _rotate(q, pos * self.factor, self.base), _rotate(k, pos, self.base)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


@pytest.mark.parametrize("base", [1e4, 1e6, 5e6])
def test_queries_at_scaled_positions_are_read_at_any_base(base):
    """A slow pair of a large base turns by 1e-6 a position: its rate in a float32 table
    is read to a few digits only, so the scaling is read from the pairs that pin it."""
    report = check(lambda: _ScaledQueries(base, 3))
    assert outcome(report) == ("rotated_queries", "rope_positions"), report.to_text(color=False)
    assert "positions times 3" in report.first_failure.message
    assert check(lambda: _ScaledQueries(base, 1)).ok
