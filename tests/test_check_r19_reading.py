"""Readings that round 19's first run (and model round 12's) asked for: the base of Llama
3.1's scaled frequencies, ALiBi slopes a model keeps beside its blocks and never hands them,
and one side's rotary positions scaled against the other's."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import check
from attnscope.checking.rotary import Rope
from attnscope.functional import alibi_slopes


def _llama31(freqs, factor=8.0, low=1.0, high=4.0, old=8192):
    """Llama 3.1's scaling by parts: fast pairs kept, slow ones divided by ``factor``."""
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def test_the_base_of_llama_31_scaled_frequencies_is_read_from_the_fast_pairs():
    plain = 500000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert Rope("interleaved", tuple(_llama31(plain)), 16).base == 500000
    assert Rope("interleaved", tuple(plain.tolist()), 16).base == 500000
    # frequencies of no scheme: no base
    odd = plain.clone()
    odd[2] *= 1.5
    assert Rope("interleaved", tuple(odd.tolist()), 16).base is None


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x, bias):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        if bias is not None:
            s = s + bias
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


class _Slopes(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(4), persistent=False)

    def forward(self, n):
        pos = torch.arange(n, dtype=self.slopes.dtype)
        return -self.slopes[:, None, None] * (pos[:, None] - pos).clamp(min=0)


class _Model(nn.Module):
    """JAIS-style: the ALiBi module sits beside the block; ``hand=False`` compares the
    position embedding type with a misspelt string and hands the block None."""

    def __init__(self, hand=True):
        super().__init__()
        torch.manual_seed(0)
        self.hand, self.relative_pe, self.block = hand, _Slopes(), _Block()

    def forward(self, x):
        bias = self.relative_pe(x.shape[1]).to(x.dtype)
        return self.block(x, bias if self.hand else None)


@pytest.mark.parametrize(
    ("hand", "want"), [(True, ("ok",)), (False, ("biased_scores", "bias_missing"))]
)
def test_alibi_slopes_kept_beside_the_block_and_never_handed_are_bias_missing(hand, want):
    report = check(lambda: _Model(hand), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)


def _rotate(x, pos, base=10000.0):
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class _OneSideScaled(nn.Module):
    """The queries rotated at positions / ``factor``, the keys at the positions: a linear
    position scaling applied to one side only."""

    def __init__(self, factor=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.factor = factor
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n)
        q, k = _rotate(q, pos / self.factor), _rotate(k, pos)
        s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
        )
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


@pytest.mark.parametrize(
    ("factor", "want"),
    [(1.0, ("ok",)), (2.0, ("rotated_queries", "rope_positions"))],
)
def test_query_positions_scaled_against_the_keys_are_rope_positions(factor, want):
    """Each side turns at its own rate; the side whose first pair turns one radian a
    position has the plain positions (it had been judged scores/not_dot_product)."""
    report = check(lambda: _OneSideScaled(factor), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
