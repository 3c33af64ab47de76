"""Readings that round 18's first run asked for: multi-query heads laid out on two axes
(levanter's ``(batch, kv, group, tokens, d)`` with one kv head) through a rotation, an ALiBi
bias the model builds and never hands its blocks, and an erf in the softmax's place."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import check
from attnscope.errors import AttnScopeError
from attnscope.functional import alibi_slopes


def _rotate_half(x, base=10000.0):
    d, n = x.shape[-1], x.shape[-2]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class _GroupedAxes(nn.Module):
    """8 query heads over ``kv`` kv heads, the queries ``(b, kv, group, n, hd)``, rotated,
    and an einsum over the group axis (no repeat)."""

    def __init__(self, kv=1):
        super().__init__()
        torch.manual_seed(0)
        self.kv, self.g = kv, 8 // kv
        self.q = nn.Linear(64, 64, bias=False)
        self.k = nn.Linear(64, 8 * kv, bias=False)
        self.v = nn.Linear(64, 8 * kv, bias=False)
        self.o = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = _rotate_half(self.q(x).view(b, n, self.kv, self.g, 8).permute(0, 2, 3, 1, 4))
        k = _rotate_half(self.k(x).view(b, n, self.kv, 8).permute(0, 2, 1, 3))
        v = self.v(x).view(b, n, self.kv, 8).permute(0, 2, 1, 3)
        s = torch.einsum("bkgpd,bksd->bkgps", q / math.sqrt(8), k)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ctx = torch.einsum("bkgps,bksd->bkgpd", s.softmax(-1), v)
        return self.o(ctx.permute(0, 3, 1, 2, 4).reshape(b, n, 64))


@pytest.mark.parametrize("kv", [1, 2], ids=["multi-query", "grouped"])
def test_query_heads_on_two_axes_through_a_rotation(kv):
    """One kv head: the kv axis of size 1 is still the outer of the two head axes (it had
    been refused as a rotation it could not read)."""
    report = check(lambda: _GroupedAxes(kv), kind="causal-multihead")
    assert outcome(report) == ("ok",), report.to_text(color=False)
    assert (report.structure["heads"], report.structure["kv_heads"]) == (8, kv)


class _AlibiBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x, bias):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        if bias is not None:
            s = s + bias
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


class _AlibiModel(nn.Module):
    """An encoder that builds its ALiBi bias ``-slope * |i - j|`` each call and hands its
    block the bias, or (``hand=False``) None."""

    def __init__(self, hand=True):
        super().__init__()
        torch.manual_seed(0)
        self.hand, self.block = hand, _AlibiBlock()

    def forward(self, x):
        n = x.shape[1]
        pos = torch.arange(n, dtype=x.dtype)
        bias = -alibi_slopes(4).to(x.dtype)[:, None, None] * (pos[:, None] - pos).abs()
        return self.block(x, bias if self.hand else None)


@pytest.mark.parametrize(
    ("hand", "want"), [(True, ("ok",)), (False, ("biased_scores", "bias_missing"))]
)
def test_an_alibi_bias_built_in_the_forward_and_dropped_is_bias_missing(hand, want):
    report = check(lambda: _AlibiModel(hand), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)


class _Laplace(nn.Module):
    """MEGA's Laplace attention function in the softmax's place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        mu, sigma = math.sqrt(0.5), math.sqrt(0.25 / math.pi)
        w = 0.5 * (1 + torch.erf((s - mu) / (sigma * math.sqrt(2))))
        return self.o((w @ v).transpose(1, 2).reshape(b, n, 32))


def test_an_erf_in_the_softmax_place_is_refused():
    with pytest.raises(AttnScopeError, match="Laplace"):
        check(_Laplace, kind="multihead")
