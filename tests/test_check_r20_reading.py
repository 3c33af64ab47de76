"""Readings that round 20's first run asked for: an output projection held as a 3-D
``(d_out, heads, hd)`` weight (Praxis, Flax) and never applied, and a layer that loops over
its tokens and heads (one query vector at a time) read in seconds."""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import check
from attnscope.checking.features import _spread


class _Praxis(nn.Module):
    """Praxis-style projections: einsum with ``(d, heads, hd)`` weights in, ``(d, heads, hd)``
    out; ``skip_post`` returns the merged heads without the output projection."""

    def __init__(self, skip_post=False):
        super().__init__()
        torch.manual_seed(0)
        self.skip_post = skip_post
        self.q, self.k, self.v, self.post = (
            nn.Parameter(torch.randn(32, 4, 8) / 6) for _ in range(4)
        )

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (torch.einsum("BTD,DNH->BNTH", x, w) for w in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        ctx = (s.softmax(-1) @ v).transpose(1, 2)  # (b, n, heads, hd)
        if self.skip_post:
            return ctx.reshape(b, n, 32)
        return torch.einsum("BTNH,DNH->BTD", ctx, self.post)


@pytest.mark.parametrize(
    ("skip", "want"), [(False, ("ok",)), (True, ("output", "missing_out_proj"))]
)
def test_a_3d_output_projection_never_applied_is_missing_out_proj(skip, want):
    report = check(lambda: _Praxis(skip), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)


def test_spread_keeps_the_first_and_the_last():
    assert _spread(list(range(5)), 8) == [0, 1, 2, 3, 4]
    picked = _spread(list(range(1000)), 48)
    assert len(picked) == 48 and picked[0] == 0 and picked[-1] == 999


class _TokenLoop(nn.Module):
    """One query and one head at a time, over every token (gemma.cpp's loops): each query's
    keys sliced up to itself (``ahead`` more past it: a slip), scores as keys @ q."""

    def __init__(self, ahead=0):
        super().__init__()
        torch.manual_seed(0)
        self.ahead = ahead
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).unbind(2)
        out = torch.zeros(b, n, 4, 8)
        for i in range(b):
            for t in range(n):
                end = t + 1 + self.ahead
                for h in range(4):
                    w = (k[i, :end, h] @ q[i, t, h] / math.sqrt(8)).softmax(-1)
                    out[i, t, h] = w @ v[i, :end, h]
        return self.o(out.reshape(b, n, 32))


@pytest.mark.parametrize(("ahead", "want"), [(0, ("ok",)), (1, ("masked_scores", "mask_diagonal"))])
def test_a_layer_looping_over_tokens_and_heads_is_read_in_seconds(ahead, want):
    """keys @ q with q one vector: the vector is the query (it had been taken for the keys,
    and the layer refused, after minutes of reading one computation per token and head)."""
    start = time.perf_counter()
    report = check(lambda: _TokenLoop(ahead), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert time.perf_counter() - start < 60
