"""Readings asked for by the first runs of round 28 and model round m21: keys rotated at
positions that are no run (a ring buffer's slot), positions restarting each patch on both
sides; a scale landed on the ALiBi bias instead of the scores (baddbmm's beta and alpha
swapped); a norm over the merged heads before the output projection (a sub-LayerNorm);
a model that shifts its token ids right before looking them up."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check


def _rotate(x, pos, base=1e4):
    """Halves pairing; ``x`` ``(..., tokens, hd)``, ``pos`` ``(tokens,)``."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class _OddPositions(nn.Module):
    """A causal rotary layer (4 heads of 16); ``keys`` / ``queries``: positions for that
    side as a function of ``arange(n)`` (the other side counts 0, 1, 2, ...)."""

    def __init__(self, queries=None, keys=None):
        super().__init__()
        torch.manual_seed(28)
        self.q_at, self.k_at = queries, keys
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n)
        q = _rotate(q, self.q_at(pos) if self.q_at else pos)
        k = _rotate(k, self.k_at(pos) if self.k_at else pos)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


@pytest.mark.parametrize(
    "queries,keys,stage",
    [
        (None, lambda p: p % 4, "rotated_keys"),  # a ring buffer's slot for the keys
        (lambda p: p % 3, None, "rotated_queries"),
        (lambda p: p % 4, lambda p: p % 4, "rotated_queries"),  # restarting each patch
    ],
)
def test_sides_rotated_at_positions_that_are_no_run_are_rope_positions(queries, keys, stage):
    """The tables show each token's position; a side at positions that are not 0, 1, 2,
    ... (one side, or both alike, which changes scores all the same) is named, not refused
    as angles that are not position x frequency (both sides) or left at the context."""
    report = check(lambda: _OddPositions(queries, keys), kind="causal-multihead")
    assert outcome(report) == (stage, "rope_positions"), report.to_text(color=False)
    assert "not 0, 1, 2" in report.first_failure.message


def test_two_rotations_of_their_own_per_pair_are_still_refused():
    """A 2-D rotary (half the pairs turned by the row, half by the column of a 4-wide
    grid): no one position per token explains every pair, so no positions are read and
    the layer is refused as before, not named."""

    class Grid(_OddPositions):
        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
            pos = torch.arange(n)
            row, col = pos // 4, pos % 4

            def turn(t):
                return torch.cat((_rotate(t[..., :8], row), _rotate(t[..., 8:], col)), -1)

            y = nn.functional.scaled_dot_product_attention(turn(q), turn(k), v)
            return self.o(y.transpose(1, 2).reshape(b, n, 64))

    with pytest.raises(AttnScopeError, match="not supported yet"):
        check(Grid, kind="multihead")


class _BaddbmmAlibi(nn.Module):
    """BLOOM's scores: ``alibi.baddbmm(q, k^T, beta=..., alpha=...)`` over (batch*heads);
    ``swapped``: beta and alpha exchanged (the scale lands on the bias)."""

    def __init__(self, swapped=False):
        super().__init__()
        torch.manual_seed(29)
        self.swapped = swapped
        self.qkv, self.dense = nn.Linear(64, 192), nn.Linear(64, 64)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, 5) / 4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 4, 3, 16).unbind(3)
        q = q.transpose(1, 2).reshape(b * 4, n, 16)
        k = k.permute(0, 2, 3, 1).reshape(b * 4, 16, n)
        v = v.transpose(1, 2).reshape(b * 4, n, 16)
        alibi = (self.slopes[:, None] * torch.arange(n)[None, :]).to(x.dtype)
        alibi = alibi.repeat(b, 1)[:, None, :]  # (b*h, 1, n)
        inv_norm = 1 / math.sqrt(16)
        beta, alpha = (inv_norm, 1.0) if self.swapped else (1.0, inv_norm)
        s = alibi.baddbmm(q, k, beta=beta, alpha=alpha).view(b, 4, n, n)
        hide = torch.ones(n, n, dtype=torch.bool).triu(1)
        w = s.masked_fill(hide, torch.finfo(s.dtype).min).softmax(-1).view(b * 4, n, n)
        y = torch.bmm(w, v).view(b, 4, n, 16).transpose(1, 2).reshape(b, n, 64)
        return self.dense(y)


def test_the_scale_applied_to_the_alibi_bias_instead_of_the_scores_is_missing_scale():
    """Unscaled scores plus a bias times 1/sqrt(d): one slip (the call's two factors
    exchanged), named at its first stage, not left to the masked scores as other."""
    assert check(_BaddbmmAlibi, kind="causal-multihead").ok
    report = check(lambda: _BaddbmmAlibi(swapped=True), kind="causal-multihead")
    assert outcome(report) == ("scaled_scores", "missing_scale"), report.to_text(color=False)
    assert "position bias" in report.first_failure.message


class _SubNorm(nn.Module):
    """A norm over the merged heads before the output projection (Kosmos-2's
    ``inner_attn_ln``: a LayerNorm; BitNet's ``attn_sub_norm``: an RMSNorm written out);
    ``slip``: the softmax over the queries; ``gate``: the normed context times a sigmoid of
    the input (which no norm explains)."""

    def __init__(self, norm="layer", slip=False, gate=False):
        super().__init__()
        torch.manual_seed(30)
        self.norm, self.slip, self.gate = norm, slip, gate
        self.q, self.k, self.v = (nn.Linear(64, 64) for _ in range(3))
        self.ln = nn.LayerNorm(64)
        self.g = nn.Parameter(torch.empty(64).uniform_(0.5, 1.5))
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.2, 0.2)
        self.gate_proj = nn.Linear(64, 64)
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, 4, 16).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = (q @ k.transpose(-2, -1) / 4.0).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
        )
        w = s.softmax(-2 if self.slip else -1)
        y = (w @ v).transpose(1, 2).reshape(b, n, 64)
        if self.norm == "layer":
            y = self.ln(y)
        else:
            h = y.to(torch.float32) if y.dtype != torch.float64 else y
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            y = self.g * h.to(y.dtype)
        if self.gate:
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.out(y)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_norm_over_the_merged_heads_before_the_output_projection_is_read(norm):
    """It had been refused as a sub-LayerNorm not modelled; now the norm that makes the
    projection's input from the merged context, exactly, is the reference's, and a slip
    before it is named."""
    report = check(lambda: _SubNorm(norm), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    assert any("over the merged heads" in n for n in report.notes)
    bad = check(lambda: _SubNorm(norm, slip=True), kind="causal-multihead")
    assert outcome(bad) == ("weights", "softmax_wrong_dim"), bad.to_text(color=False)


def test_a_norm_with_a_gate_after_it_is_refused_naming_the_norm():
    with pytest.raises(AttnScopeError, match="applied to the context before the output"):
        check(lambda: _SubNorm("layer", gate=True), kind="causal-multihead")


class _ShiftedIds(nn.Module):
    """Trax's language model: the ids shifted right (a column of zeros before them, the
    last cut off), looked up by indexing a parameter table, one causal attention layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(31)
        self.table = nn.Parameter(torch.randn(50, 32))
        self.attn = _Causal()
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        pad = torch.zeros(ids.shape[0], 1, dtype=ids.dtype)
        shifted = torch.cat([pad, ids], dim=1)[:, : ids.shape[1]]
        h = self.table[shifted]
        return self.head(h + self.attn(h))


class _Causal(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


def test_ids_shifted_right_before_the_lookup_are_still_token_ids():
    """The model was probed with vectors (and raised on every one) because the look-up
    read ids made by a ``cat`` of the ids, which are ids still."""
    report = check(_ShiftedIds)
    assert report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["attn"]
