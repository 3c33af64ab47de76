"""Round 14's readings, each on a small self-written layer: a layer inside a wrapper handed
its hidden states channels first, a product's operands named through reused local names, a
combined k/v projection reshaped wrongly, and three refusals (keys and values pooled over
the tokens, a rotation before the projections, a projection over the tokens)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check


class _ConvAttention(nn.Module):
    """Channels-first attention (b, d, t) with 1x1 Conv1d projections (VITS)."""

    def __init__(self, d=32, heads=4, bug=None):
        super().__init__()
        self.h, self.bug = heads, bug
        self.q, self.k, self.v, self.o = (nn.Conv1d(d, d, 1) for _ in range(4))

    def forward(self, x):
        b, d, t = x.shape
        hd = d // self.h
        q = self.q(x)
        if self.bug == "split":  # the view read as (b, h, t, hd) without the transpose
            q = q.view(b, self.h, t, hd)
        else:
            q = q.view(b, self.h, hd, t).transpose(2, 3)
        k = self.k(x).view(b, self.h, hd, t).transpose(2, 3)
        v = self.v(x).view(b, self.h, hd, t).transpose(2, 3)
        w = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(hd), dim=-1)
        if self.bug == "merge":  # (b, h, t, hd) viewed as (b, d, t) without the transpose
            return self.o((w @ v).reshape(b, d, t))
        return self.o((w @ v).transpose(2, 3).reshape(b, d, t))


class _ChannelsFirstBody(nn.Module):
    def __init__(self, bug=None):
        super().__init__()
        torch.manual_seed(0)
        self.attn = _ConvAttention(bug=bug)
        self.gain = nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        y = x.transpose(1, 2)
        y = y + self.attn(y)
        return (y * self.gain[:, None]).transpose(1, 2)


def test_a_layer_handed_channels_first_is_entered_and_passes():
    report = check(_ChannelsFirstBody().eval(), kind="multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["heads"] == 4


def test_a_layer_handed_channels_first_shows_its_heads_split():
    report = check(_ChannelsFirstBody(bug="split").eval(), kind="multihead")
    assert outcome(report) == ("queries", "heads_split"), report.to_text(color=False)


class _FusedQKV(nn.Module):
    """GPT-2 style: one c_attn, scores by baddbmm on locals whose names are swapped."""

    def __init__(self, d=32, heads=4, swapped=False):
        super().__init__()
        torch.manual_seed(1)
        self.h, self.swapped = heads, swapped
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        hd = d // self.h
        query, key, value = (
            t.view(b, n, self.h, hd).transpose(1, 2) for t in self.c_attn(x).split(d, dim=2)
        )
        s = (self._swapped if self.swapped else self._scores)(query, key, b, n, hd)
        w = s.reshape(b, self.h, n, n).softmax(-1)
        return self.c_proj((w @ value).transpose(1, 2).reshape(b, n, d))

    def _scores(self, query, key, b, n, hd):
        q, k = query.reshape(-1, n, hd), key.transpose(-1, -2).reshape(-1, hd, n)
        return torch.baddbmm(torch.empty(b * self.h, n, n), q, k, beta=0, alpha=hd**-0.5)

    def _swapped(self, query, key, b, n, hd):  # named q and k, made from key and query
        q, k = key.reshape(-1, n, hd), query.transpose(-1, -2).reshape(-1, hd, n)
        return torch.baddbmm(torch.empty(b * self.h, n, n), q, k, beta=0, alpha=hd**-0.5)


def test_a_layer_handed_channels_first_shows_its_heads_merge():
    report = check(_ChannelsFirstBody(bug="merge").eval(), kind="multihead")
    assert outcome(report) == ("output", "heads_merge"), report.to_text(color=False)


def test_operands_named_through_their_local_assignment():
    report = check(_FusedQKV(swapped=True).eval(), kind="multihead")
    assert outcome(report) == ("scores", "scores_transposed"), report.to_text(color=False)
    assert check(_FusedQKV().eval(), kind="multihead").ok


class _FusedKV(nn.Module):
    """PVT-style q Linear and a fused kv Linear."""

    def __init__(self, d=32, heads=4, pair_first=False):
        super().__init__()
        torch.manual_seed(2)
        self.h, self.pair_first = heads, pair_first
        self.q, self.kv, self.proj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        hd = d // self.h
        q = self.q(x).reshape(b, n, self.h, hd).permute(0, 2, 1, 3)
        if self.pair_first:
            kv = self.kv(x).reshape(b, 2, self.h, -1, hd).permute(1, 0, 2, 3, 4)
        else:
            kv = self.kv(x).reshape(b, -1, 2, self.h, hd).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        w = (q @ k.transpose(-2, -1) * hd**-0.5).softmax(-1)
        return self.proj((w @ v).transpose(1, 2).reshape(b, n, d))


def test_a_combined_kv_projection_reshaped_pair_first():
    report = check(_FusedKV(pair_first=True).eval(), kind="multihead")
    assert outcome(report) == ("keys", "heads_split"), report.to_text(color=False)
    assert check(_FusedKV().eval(), kind="multihead").ok


class _Plain(nn.Module):
    def __init__(self, d=32, heads=4, what=None):
        super().__init__()
        torch.manual_seed(3)
        self.h, self.what = heads, what
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.rows = nn.Parameter(torch.randn(64, 5) / 8)

    def forward(self, x):
        b, n, d = x.shape
        hd = d // self.h
        xq = xk = xv = x
        if self.what == "pooled":
            xk = xv = F.adaptive_avg_pool1d(x.transpose(1, 2), 3).transpose(1, 2)
        if self.what == "rotated":
            pos = torch.arange(n, dtype=x.dtype)[:, None] * torch.arange(1, d // 2 + 1)[None] / d
            cos, sin = torch.cat([pos.cos()] * 2, -1), torch.cat([pos.sin()] * 2, -1)
            half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
            xq = xk = x * cos + half * sin
        k, v = self.k(xk), self.v(xv)
        if self.what == "tokens":
            k = torch.einsum("bnd,nk->bkd", k, self.rows[:n])
            v = torch.einsum("bnd,nk->bkd", v, self.rows[:n])
        q = self.q(xq).view(b, n, self.h, hd).transpose(1, 2)
        k, v = (t.view(b, -1, self.h, hd).transpose(1, 2) for t in (k, v))
        w = (q @ k.transpose(-2, -1) * hd**-0.5).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    "what,words",
    [
        ("pooled", "pooled over the tokens"),
        ("rotated", "rotation applied to the layer's input before"),
        ("tokens", "projection over the tokens"),
    ],
)
def test_refused_by_name(what, words):
    with pytest.raises(AttnScopeError) as got:
        check(_Plain(what=what).eval(), kind="multihead")
    assert words in str(got.value) and "not supported" in str(got.value)
