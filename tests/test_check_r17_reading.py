"""Readings that round 17's first run (and model round 10's) asked for: a rotary base read
to four digits, a QK norm applied after the rotation to queries pre-divided by sqrt(d), keys
and values made by one einsum whose weight stacks them (Gemma's Flax ``kv_einsum``), a
layer returning ``(cache, output)``, and different weights for different parts of the
input (a multiway layer) and a term made from the queries and a learned table mixed into the
scores (relative position attention, CoPE) refused."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import check
from attnscope.checking.probe import first_tensor
from attnscope.errors import AttnScopeError


def _rotate_half(x, base):
    """x ``(B, H, T, D)`` turned at positions 0..T-1, halves paired."""
    d, n = x.shape[-1], x.shape[-2]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class _Layer(nn.Module):
    """4 heads of 16, causal, rotary with ``base``. ``norm``: None, "before" or "after" the
    rotation (a per-head LayerNorm with gains and shifts); the queries are divided by
    sqrt(d) before the product, as Equinox's core does. ``kv_einsum``: keys and values
    from one ``(2, kv, d, hd)`` weight, Gemma's Flax layout, and ``(None, out)`` returned."""

    def __init__(self, base=1024.0, norm=None, kv_einsum=False):
        super().__init__()
        torch.manual_seed(0)
        self.base, self.norm, self.kv_einsum = base, norm, kv_einsum
        self.q = nn.Linear(64, 64, bias=False)
        if kv_einsum:
            self.kv = nn.Parameter(torch.randn(2, 4, 64, 16) / 8)
        else:
            self.k = nn.Linear(64, 64, bias=False)
            self.v = nn.Linear(64, 64, bias=False)
        self.o = nn.Linear(64, 64, bias=False)
        self.q_norm, self.k_norm = nn.LayerNorm(16), nn.LayerNorm(16)
        with torch.no_grad():
            for n in (self.q_norm, self.k_norm):
                n.weight.uniform_(0.5, 1.5)
                n.bias.uniform_(-0.3, 0.3)

    def _qk(self, t, norm):
        if self.norm == "before":
            t = norm(t)
        t = _rotate_half(t, self.base)
        return norm(t) if self.norm == "after" else t

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 16).transpose(1, 2)
        if self.kv_einsum:
            kv = torch.einsum("BSD,CKDH->CBSKH", x, self.kv)
            k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        else:
            k = self.k(x).view(b, n, 4, 16).transpose(1, 2)
            v = self.v(x).view(b, n, 4, 16).transpose(1, 2)
        q, k = self._qk(q, self.q_norm), self._qk(k, self.k_norm)
        q = q / math.sqrt(16)
        s = (q @ k.transpose(-1, -2)).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
        )
        out = self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 64))
        return (None, out) if self.kv_einsum else out


def test_a_rotary_base_of_1024_is_read_as_1024():
    """Read to four significant digits (three had made 1024 read as 1020)."""
    report = check(lambda: _Layer(base=1024.0), kind="causal-multihead")
    assert outcome(report) == ("ok",), report.to_text(color=False)
    assert report.structure["rope"]["base"] == 1024


@pytest.mark.parametrize(
    ("norm", "want"),
    [("before", ("ok",)), ("after", ("normed_queries", "qk_norm_misplaced"))],
)
def test_qk_norm_after_the_rotation_on_prescaled_queries(norm, want):
    """The queries divided by sqrt(d) after the norm: the misplaced norm is read with that
    factor folded in (it had been refused as a rotation it could not read)."""
    report = check(lambda: _Layer(base=10000.0, norm=norm), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)


def test_keys_and_values_from_one_stacked_einsum_weight_and_a_cache_first_return():
    """``"BSD,CKDH->CBSKH"`` at a batch of 2, whose C is 2 as well: the rows are placed by
    the einsum's letters, not by their sizes; ``(None, out)``: the output is the first
    tensor returned."""
    report = check(lambda: _Layer(base=10000.0, kv_einsum=True), kind="causal-multihead")
    assert outcome(report) == ("ok",), report.to_text(color=False)


def test_first_tensor_skips_what_is_not_a_tensor():
    out = torch.ones(2)
    assert first_tensor((None, out)) is out
    assert first_tensor(({"k": 1}, out)) is out
    assert first_tensor((out, None)) is out


class _Multiway(nn.Module):
    """BEiT-3's multiway attention: the first 3 tokens projected by one set of weights, the
    rest by another."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.b = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.o = nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (
            torch.cat([pa(x[:, :3]), pb(x[:, 3:])], 1).view(b, n, 4, 8).transpose(1, 2)
            for pa, pb in zip(self.a, self.b, strict=True)
        )
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


def test_a_multiway_layer_is_refused():
    with pytest.raises(AttnScopeError, match="multiway"):
        check(_Multiway, kind="multihead")


class _QueriesTimesTable(nn.Module):
    """Shaw-style relative attention: ``q @ table`` picked by the distance and added to the
    scores, the table a parameter of the layer's own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(32, 96)
        self.o = nn.Linear(32, 32)
        self.table = nn.Parameter(torch.randn(8, 16) / 4)  # (head_dim, distances)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        rel = q @ self.table  # (b, heads, n, distances)
        dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).clamp(0, 15)
        s = (q @ k.transpose(-1, -2) + rel.gather(-1, dist.expand(b, 4, n, n))) / math.sqrt(8)
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


def test_a_learned_table_times_the_queries_in_the_scores_is_refused():
    with pytest.raises(AttnScopeError, match="learned table"):
        check(_QueriesTimesTable, kind="multihead")
