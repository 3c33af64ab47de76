"""Readings that round 13's first run asked for: projections known only by their place in a
list, an output projection computed and dropped, an ALiBi matrix built for the layers and
never handed them, and two features refused by name (a convolution over the tokens on the
way to q/k/v, additive attention)."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check
from attnscope.functional import alibi_slopes


class _Listed(nn.Module):
    """The Annotated Transformer's layer: ``clones(nn.Linear, 4)`` zipped with (query, key,
    value), the last the output. ``slip``: ``keys_times_queries`` (keys @ queries^T) or
    ``dropped_out`` (the output projection computed and the merged heads returned)."""

    def __init__(self, slip=None, d=32, h=4):
        super().__init__()
        torch.manual_seed(0)
        self.slip, self.h, self.dk = slip, h, d // h
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, query, key, value):
        b = query.shape[0]
        q, k, v = (
            lin(x).view(b, -1, self.h, self.dk).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value), strict=False)
        )
        s = (
            k @ q.transpose(-2, -1)
            if self.slip == "keys_times_queries"
            else q @ k.transpose(-2, -1)
        )
        x = (
            (torch.softmax(s / math.sqrt(self.dk), -1) @ v)
            .transpose(1, 2)
            .reshape(b, -1, self.h * self.dk)
        )
        out = self.linears[-1](x)
        return x if self.slip == "dropped_out" else out


class _Sublayer(nn.Module):
    """BERT4Rec's block: the layer called through ``.forward`` (no module hooks) inside a
    residual around a pre-norm."""

    def __init__(self, slip=None):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attention = _Listed(slip)

    def forward(self, x):
        y = self.norm(x)
        return x + self.attention.forward(y, y, y)


@pytest.mark.parametrize(
    "slip,want",
    [
        (None, ("ok",)),
        ("keys_times_queries", ("scores", "scores_transposed")),
        ("dropped_out", ("output", "missing_out_proj")),
    ],
)
def test_annotated_transformer_slips(slip, want):
    """Place in the list and call order agree that the list is [q, k, v]: keys @ queries^T
    reads as the slip it is (it had passed, the two weights read the other way round); an
    output projection made and dropped is missing_out_proj (it had been output/other)."""
    report = check(lambda: _Sublayer(slip), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)


class _MosaicSelf(nn.Module):
    def __init__(self, d=48, h=6):
        super().__init__()
        self.h, self.dk = h, d // h
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.dk).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.dk) + bias
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _Mosaic(nn.Module):
    """MosaicBERT: the encoder builds a symmetric ALiBi matrix for its layers
    (``slope_h * -|i - j|``) and hands it to the layer, or (``handed=False``) hands the
    padding bias alone."""

    def __init__(self, handed=True, h=6, size=32):
        super().__init__()
        torch.manual_seed(0)
        self.handed = handed
        self.layer = _MosaicSelf(h=h)
        pos = torch.arange(size)
        slopes = alibi_slopes(h).float()[:, None, None]
        self.alibi = slopes * -(pos[None, :] - pos[:, None]).abs()[None]

    def forward(self, x):
        n = x.shape[1]
        padding = torch.zeros(1, 1, n, n)
        bias = padding + self.alibi[None, :, :n, :n]
        return x + self.layer(x, bias if self.handed else padding)


def test_an_alibi_matrix_built_for_the_layers_and_never_handed_is_bias_missing():
    report = check(lambda: _Mosaic(True), kind="multihead")
    assert report.ok and report.structure["bias"] == "alibi", report.to_text(color=False)
    report = check(lambda: _Mosaic(False), kind="multihead")
    assert outcome(report) == ("biased_scores", "bias_missing"), report.to_text(color=False)
    assert any("'alibi'" in n for n in report.notes), report.notes


class _Convolved(nn.Module):
    """Primer: a depthwise convolution over the tokens after each projection."""

    def __init__(self, kernel=3, d=32, h=4):
        super().__init__()
        torch.manual_seed(0)
        self.kernel, self.h, self.dk = kernel, h, d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.convs = nn.ModuleList(nn.Conv1d(d, d, kernel, groups=d) for _ in range(3))

    def forward(self, x):
        b, n, d = x.shape
        heads = []
        for proj, conv in zip((self.q, self.k, self.v), self.convs, strict=True):
            t = F.pad(proj(x).transpose(1, 2), (self.kernel - 1, 0))
            heads.append(conv(t).transpose(1, 2).reshape(b, n, self.h, self.dk).transpose(1, 2))
        q, k, v = heads
        w = (q @ k.transpose(-1, -2) / math.sqrt(self.dk)).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, d))


def test_a_convolution_over_the_tokens_before_the_scores_is_refused_by_name():
    with pytest.raises(AttnScopeError, match="convolution over the tokens"):
        check(lambda: _Convolved(3), kind="multihead")


class _Additive(nn.Module):
    """GAT: ``e_ij = leaky_relu(a_1 . Wh_i + a_2 . Wh_j)``, a softmax over j, then ``e @ Wh``."""

    def __init__(self, d=32, h=8):
        super().__init__()
        torch.manual_seed(0)
        self.W = nn.Parameter(torch.randn(d, h) * 0.3)
        self.a = nn.Parameter(torch.randn(2 * h, 1) * 0.3)
        self.o = nn.Linear(h, d)

    def forward(self, x):
        wh = x @ self.W
        h = wh.shape[-1]
        e = F.leaky_relu(wh @ self.a[:h] + (wh @ self.a[h:]).transpose(-1, -2), 0.2)
        return self.o(e.softmax(-1) @ wh)


def test_additive_attention_is_refused_by_name():
    """Its scores are a per-query term plus a per-key term: no dot product to judge."""
    with pytest.raises(AttnScopeError, match="additive attention"):
        check(lambda: _Additive())


class _Landmarks(nn.Module):
    """Nystromformer's approximation: ``softmax(Q L^T) @ softmax(L L^T) @ softmax(L K^T) @ V``
    (without the pseudo-inverse), the landmarks L the means of query segments."""

    def __init__(self, d=32, h=4, m=2):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.dk, self.m = h, d // h, m
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            p(x).view(b, n, self.h, self.dk).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        marks = q[:, :, : n - n % self.m].reshape(b, self.h, self.m, -1, self.dk).mean(-2)
        k1 = (q @ marks.transpose(-1, -2)).softmax(-1)
        k2 = (marks @ marks.transpose(-1, -2)).softmax(-1)
        k3 = (marks @ k.transpose(-1, -2)).softmax(-1)
        ctx = (k1 @ k2) @ (k3 @ v)
        return self.o(ctx.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("regroup", [False, True])
def test_weights_made_as_a_product_of_softmax_maps_are_refused_by_name(regroup):
    """Whichever is seen first names it: the softmax maps multiplied together, or (as
    Nystromformer groups its products) the landmarks' map times the values, a product
    over the tokens that leaves no token-by-token weights."""
    layer = _Landmarks()
    if regroup:
        layer.forward = types.MethodType(_landmarks_weights_first, layer)
    with pytest.raises(AttnScopeError, match="not supported yet") as info:
        check(lambda: layer, kind="multihead")
    said = str(info.value)
    assert "product of softmax maps" in said or "multiplied over the tokens" in said, said


def _landmarks_weights_first(self, x):
    """The same maps, the token-by-token weights made first: ``(k1 @ k2 @ k3) @ V``."""
    b, n, d = x.shape
    q, k, v = (p(x).view(b, n, self.h, self.dk).transpose(1, 2) for p in (self.q, self.k, self.v))
    marks = q[:, :, : n - n % self.m].reshape(b, self.h, self.m, -1, self.dk).mean(-2)
    k1 = (q @ marks.transpose(-1, -2)).softmax(-1)
    k2 = (marks @ marks.transpose(-1, -2)).softmax(-1)
    k3 = (marks @ k.transpose(-1, -2)).softmax(-1)
    return self.o(((k1 @ k2 @ k3) @ v).transpose(1, 2).reshape(b, n, d))
