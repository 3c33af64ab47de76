"""Readings that round 21's first run asked for: a window declared on the attention backend
a layer keeps (vLLM's and Aphrodite's ``Attention``), every query rotated for the last
position, and ALiBi switched on in a configuration dict with no bias added."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import check
from attnscope.functional import alibi_slopes


def _rotate(x, pos, base=10000.0):
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class _Backend(nn.Module):
    """The attention backend object: no weights, the window it applies (``extra``: keys past
    the declared window, a slip)."""

    def __init__(self, sliding_window, extra=0):
        super().__init__()
        self.sliding_window, self.extra = sliding_window, extra

    def forward(self, q, k, v):
        n = q.shape[-2]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & (i - j < self.sliding_window + self.extra)
        s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed, float("-inf"))
        return s.softmax(-1) @ v


class _Layer(nn.Module):
    """Rotary, causal, a window of 8 on its backend; ``query_at`` "last" rotates every query
    for the last position (a decoding step's position given to the whole prompt)."""

    def __init__(self, extra=0, query_at="own"):
        super().__init__()
        torch.manual_seed(0)
        self.query_at = query_at
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)
        self.attn = _Backend(8, extra)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n)
        q = _rotate(q, torch.full((n,), n - 1) if self.query_at == "last" else pos)
        k = _rotate(k, pos)
        return self.o(self.attn(q, k, v).transpose(1, 2).reshape(b, n, 32))


@pytest.mark.parametrize(("extra", "want"), [(0, ("ok",)), (1, ("masked_scores", "window_size"))])
def test_a_window_declared_on_the_layer_s_attention_backend(extra, want):
    """The backend's ``sliding_window = 8`` is the declaration (the mask read at 40 tokens
    shows 9 keys where a window is one wider: it had passed as a window of 9)."""
    report = check(lambda: _Layer(extra), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.structure["window"] == 8


def test_every_query_rotated_for_the_last_position_is_rope_positions():
    """The keys' rotation gives the frequencies (the queries' turn by none from one token to
    the next); it had been judged scores/not_dot_product."""
    report = check(lambda: _Layer(query_at="last"), kind="causal-multihead")
    assert outcome(report) == ("rotated_queries", "rope_positions"), report.to_text(color=False)


class _Mpt(nn.Module):
    """MPT-style: ``config.attn_config = {"alibi": True, ...}``; ``flag`` names the key the
    layer reads (a misspelt one builds no bias)."""

    def __init__(self, flag="alibi"):
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(attn_config={"alibi": True}, n_heads=4)
        self.flag = flag
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        if self.config.attn_config.get(self.flag, False):
            pos = torch.arange(n, dtype=x.dtype)
            s = s - alibi_slopes(4).to(x.dtype)[:, None, None] * (pos[:, None] - pos).clamp(min=0)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


@pytest.mark.parametrize(
    ("flag", "want"), [("alibi", ("ok",)), ("alibi_bias", ("biased_scores", "bias_missing"))]
)
def test_alibi_switched_on_in_a_config_dict_and_not_added_is_bias_missing(flag, want):
    report = check(lambda: _Mpt(flag), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
