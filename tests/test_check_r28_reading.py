"""Readings asked for by the first runs of rounds 28-33 and model rounds m21-m26.

Round 28 and m21: keys rotated at positions that are no run (a ring buffer's slot),
positions restarting each patch on both sides; a scale landed on the ALiBi bias instead of
the scores (baddbmm's beta and alpha swapped); a norm over the merged heads before the
output projection (a sub-LayerNorm); a model that shifts its token ids right before looking
them up. Round 29 and m22: q, k and v side by side in every column triple; attention on
blocks of the tokens; an RMSNorm written with ``F.normalize``; the future split off an
ALiBi mask and zeroed after the softmax; a 0/1 mask added; a decoding step that writes its
key into a copy, or scores the cached keys apart from its own. Round 30 and m23: a mask
broadcast between the query and key axes, or in a layout not read; a cross layer's norm
on its queries' side; a window in keys beside the pair converted from it; heads cut wrongly
after a full-width norm; clipped projections; a decoding divergence a non-causal layer
explains. Round 31: a combined projection reshaped parts-first under a QK norm; an ALiBi
mask whose future is 0. m26: query heads folded into their group's rows."""

from __future__ import annotations

import math
from types import SimpleNamespace

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


# ---------------------------------------------------------------- round 29 and m22


class _Woven(nn.Module):
    """alpa's OPT: one combined projection viewed ``(b, s, heads, head_dim, 3)`` and
    unbound on the last axis; ``swapped``: the scores' einsum takes keys times queries."""

    def __init__(self, swapped=False):
        super().__init__()
        torch.manual_seed(32)
        self.swapped = swapped
        self.qkv, self.dense = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 4, 16, 3).unbind(-1)
        q = q / 4.0
        spec = "bkhd,bqhd->bhqk" if self.swapped else "bqhd,bkhd->bhqk"
        s = torch.einsum(spec, q, k)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(b, n, 64)
        return self.dense(y)


def test_q_k_v_side_by_side_in_every_column_triple_is_a_layout():
    """Each role's heads are every third column: the layout the computation cuts, read as
    it is (it was queries/other in every layer); keys times queries is named."""
    report = check(_Woven, kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    bad = check(lambda: _Woven(swapped=True), kind="causal-multihead")
    assert outcome(bad) == ("scores", "scores_transposed"), bad.to_text(color=False)


class _Blocks(nn.Module):
    """Attention computed separately in blocks of the tokens (TRELLIS's shifted windows)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(33)
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, 4, 16)
        outs = []
        for lo in range(0, n, 4):
            q, k, v = qkv[:, lo : lo + 4].permute(2, 0, 3, 1, 4)
            outs.append(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2))
        return self.out(torch.cat(outs, 1).reshape(b, n, 64))


def test_attention_on_blocks_of_the_tokens_is_refused_not_judged():
    """A correct layer of a kind the reference does not model had been failed at
    `queries`/`other`: now refused, naming the blocks."""
    with pytest.raises(AttnScopeError, match="blocks of the tokens"):
        check(_Blocks, kind="multihead")


class _NormalizeRMS(nn.Module):
    """TRELLIS's MultiHeadRMSNorm, ``F.normalize(x) * gamma * sqrt(d)``, on queries and
    keys; ``scale``: the scores' factor; ``cosine``: no ``sqrt(d)`` (cosine attention, a
    learned temperature of 10 instead of a scale)."""

    def __init__(self, scale=0.25, cosine=False):
        super().__init__()
        torch.manual_seed(34)
        self.scale, self.cosine = scale, cosine
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)
        self.gq = nn.Parameter(torch.empty(4, 16).uniform_(0.5, 1.5))
        self.gk = nn.Parameter(torch.empty(4, 16).uniform_(0.5, 1.5))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 16).unbind(2)
        if self.cosine:
            q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
        else:
            q = nn.functional.normalize(q, dim=-1) * self.gq * 4.0
            k = nn.functional.normalize(k, dim=-1) * self.gk * 4.0
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-2, -1) * (10.0 if self.cosine else self.scale)
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 64))


def test_an_rms_norm_written_with_normalize_is_no_cosine_attention():
    """Unit length times sqrt(d) is an RMSNorm: a wrong scale after it is named (it was
    refused as cosine attention); its structure has no rotation read from float32 noise;
    true cosine attention with a temperature of its own is still refused."""
    ok = check(_NormalizeRMS, kind="multihead")
    assert ok.ok and ok.structure["qk_norm"] == "per-head", ok.to_text(color=False)
    assert ok.structure["rope"] is None
    bad = check(lambda: _NormalizeRMS(scale=1 / 16), kind="multihead")
    assert outcome(bad) == ("scaled_scores", "wrong_scale"), bad.to_text(color=False)
    with pytest.raises(AttnScopeError, match="cosine"):
        check(lambda: _NormalizeRMS(cosine=True), kind="multihead")


class _AlibiSplit(nn.Module):
    """Baichuan's ALiBi: one mask of key-position biases and -inf future; ``after``: the
    future split off it with ``isinf`` and zeroed after the softmax instead."""

    def __init__(self, after=False):
        super().__init__()
        torch.manual_seed(35)
        self.after = after
        self.W_pack, self.o_proj = nn.Linear(64, 192, bias=False), nn.Linear(64, 64)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, 5) / 4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.W_pack(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        bias = self.slopes[:, None, None] * torch.arange(n)[None, None, :]
        mask = bias.expand(4, n, n).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
        )
        s = q @ k.transpose(-2, -1) / 4.0
        if self.after:
            future = torch.isinf(mask)
            w = (s + mask.masked_fill(future, 0.0)).softmax(-1).masked_fill(future, 0.0)
        else:
            w = (s + mask).softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, n, 64))


def test_the_future_split_off_an_alibi_mask_and_zeroed_after_the_softmax():
    assert check(_AlibiSplit, kind="causal-multihead").ok
    bad = check(lambda: _AlibiSplit(after=True), kind="causal-multihead")
    assert outcome(bad) == ("weights", "mask_after_softmax"), bad.to_text(color=False)


class _ZeroOneMask(nn.Module):
    """fish-speech's boolean tril cast to the activations' dtype and passed to SDPA, which
    adds it: 1 where a key is seen, 0 where hidden."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(36)
        self.wqkv, self.wo = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        mask = torch.ones(n, n, dtype=torch.bool).tril().to(x.dtype)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, n, 64))


def test_a_zero_one_triangle_added_is_a_causal_mask_with_the_wrong_fill_when_inferred():
    """With the kind inferred it had been an encoder failing at the context; the triangle
    of two finite values says decoder, and the fill is named."""
    report = check(_ZeroOneMask)
    assert report.kind == "causal-multihead", report.kind_reason
    assert outcome(report) == ("masked_scores", "mask_fill_value"), report.to_text(color=False)


class _BufferLM(nn.Module):
    """A model with its cache in its layers' buffers (the book's protocol); ``slip``:
    "copy": a step writes its key and value into a copy of the buffers and reads the
    buffers; "apart": a step scores the cached keys apart from its own, with a window of
    2 the full pass has and the step's mask forgets."""

    def __init__(self, slip=None):
        super().__init__()
        torch.manual_seed(37)
        self.emb, self.head = nn.Embedding(40, 32), nn.Linear(32, 40)
        self.layers = nn.ModuleList(_BufferLayer(slip) for _ in range(2))

    def reset_kv_cache(self):
        for layer in self.layers:
            layer.past = 0

    def forward(self, ids, use_cache=False):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h, use_cache)
        return self.head(h)


class _BufferLayer(nn.Module):
    def __init__(self, slip):
        super().__init__()
        self.slip, self.past = slip, 0
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)
        self.register_buffer("k_cache", torch.zeros(4, 4, 64, 8), persistent=False)
        self.register_buffer("v_cache", torch.zeros(4, 4, 64, 8), persistent=False)

    def forward(self, x, use_cache):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        past = self.past if use_cache else 0
        window = 2 if self.slip == "apart" else None
        if use_cache and past and self.slip == "apart":
            # NxDI's token generation: the whole preallocated cache, every slot written
            # before this step seen (the window forgotten: the slip), its own key apart
            prior_k, prior_v = self.k_cache[:b], self.v_cache[:b]
            written = torch.arange(prior_k.shape[2]) < past
            prior = q @ prior_k.transpose(-2, -1) / math.sqrt(8)
            prior = prior.masked_fill(~written, torch.finfo(prior.dtype).min)
            own = q @ k.transpose(-2, -1) / math.sqrt(8)
            top = torch.maximum(prior.amax(-1, keepdim=True), own.amax(-1, keepdim=True))
            e_prior, e_own = (prior - top).exp(), (own - top).exp()
            denom = e_prior.sum(-1, keepdim=True) + e_own.sum(-1, keepdim=True)
            y = (e_prior / denom) @ prior_v + (e_own / denom) @ v
            # the cache updated after the step, as NxDI's manager does
            self.k_cache[:b, :, past : past + n] = k
            self.v_cache[:b, :, past : past + n] = v
            self.past = past + n
            return self.o(y.transpose(1, 2).reshape(b, n, 32))
        if use_cache:
            target_k, target_v = self.k_cache, self.v_cache
            if past and self.slip == "copy":
                target_k, target_v = self.k_cache.clone(), self.v_cache.clone()
            target_k[:b, :, past : past + n] = k
            target_v[:b, :, past : past + n] = v
            k, v = self.k_cache[:b, :, : past + n], self.v_cache[:b, :, : past + n]
            self.past = past + n
        total = k.shape[2]
        i = torch.arange(n)[:, None] + past
        j = torch.arange(total)[None, :]
        seen = j <= i
        if window is not None:
            seen = seen & (i - j < window)
        s = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~seen, float("-inf"))
        w = s.softmax(-2 if getattr(self, "leak", False) else -1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, 32))


@pytest.mark.parametrize("slip,code", [("copy", "cache_stale"), ("apart", "cache_mask")])
def test_a_step_that_writes_a_copy_or_scores_the_cache_apart_is_named(slip, code):
    """A step whose queries meet only keys nothing of it reached is the cache not updated
    (it had been named cache_mask); a step that scores the cached keys apart from its own,
    with the same keys, and differs, is the mask (it had been cache_stale, from its own
    key alone)."""
    assert check(_BufferLM).ok
    report = check(lambda: _BufferLM(slip))
    assert report.decode is not None, report.to_text(color=False)
    assert (report.decode.mistake, report.decode.step) == (code, 0), report.to_text(color=False)
    # the evidence named: the product that meets keys made without the step's token
    assert "without it" in report.decode.message or "apart" in report.decode.message


# ---------------------------------------------------------------- round 30 and m23


class _PenzaiMask(nn.Module):
    """penzai's scores laid out ``(b, s, kv_heads, q_rep, t)``, a causal window of 4 applied
    by ``torch.where`` with a mask ``(b, s, 1, 1, t)``; ``layout``: "read" as penzai has it,
    or "unread", the mask laid out ``(s, b, 1, t)`` over scores ``(s, b, h, t)``."""

    def __init__(self, layout="read"):
        super().__init__()
        torch.manual_seed(38)
        self.layout = layout
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).unbind(2)
        pos = torch.arange(n)
        seen = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 4)
        if self.layout == "read":  # 2 key/value heads, each read by 2 query heads
            q, k, v = self.qkv(x)[..., :64].split([32, 16, 16], dim=-1)
            q, k, v = q.view(b, n, 2, 2, 8), k.view(b, n, 2, 8), v.view(b, n, 2, 8)
            s = torch.einsum("bskrd,btkd->bskrt", q, k)
            s = torch.where(seen[None, :, None, None, :], s / 8**0.5, torch.tensor(-1e30))
            y = torch.einsum("bskrt,btkd->bskrd", s.softmax(-1), v)
            return self.o(y.reshape(b, n, 32))
        s = torch.einsum("bqhd,bkhd->qbhk", q, k) / 8**0.5
        s = torch.where(seen[:, None, None, :].expand(n, b, 1, n), s, torch.tensor(-1e9))
        y = torch.einsum("qbhk,bkhd->bqhd", s.softmax(-1), v).reshape(b, n, 32)
        return self.o(y)


def test_a_window_mask_broadcast_between_the_query_and_key_axes_is_read():
    """The query axis apart from the keys' by axes of one: the window is read (it had been
    no mask at all, and a correct local layer of a model failed at `scores`)."""
    report = check(_PenzaiMask, kind="causal-multihead")
    assert report.ok and report.structure["window"] == 4, report.to_text(color=False)


def test_a_mask_in_a_layout_not_read_is_refused_not_judged():
    """A correct windowed layer whose mask no reading places had been failed at `weights`
    (`not_softmax`): it hides scores, so without it nothing can be judged."""
    with pytest.raises(AttnScopeError, match="mask on the scores in a layout not read"):
        check(lambda: _PenzaiMask("unread"), kind="causal-multihead")


class _ExpertCross(nn.Module):
    """SmolVLA's action expert: the wrapper norms its own hidden states for the queries,
    and projects keys and values from the VLM's states (``slip``: from its own)."""

    def __init__(self, slip=False):
        super().__init__()
        torch.manual_seed(39)
        self.slip = slip
        self.norm = nn.LayerNorm(32)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(32, 32) for _ in range(3))
        self.o_proj = nn.Linear(32, 32)

    def forward(self, expert_hidden, vlm_kv_states):
        b, n, _ = expert_hidden.shape
        h = self.norm(expert_hidden)
        src = h if self.slip else vlm_kv_states
        q = self.q_proj(h).view(b, n, 4, 8).transpose(1, 2)
        k = self.k_proj(src.view(*src.shape[:2], -1)).view(b, -1, 4, 8).transpose(1, 2)
        v = self.v_proj(src).view(b, -1, 4, 8).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return expert_hidden + self.o_proj(y.transpose(1, 2).reshape(b, n, 32))


def test_a_norm_on_the_queries_side_alone_of_a_cross_layer_is_its_input():
    """The queries read the expert's normed states, the keys the VLM's raw ones: the norm
    is the layer's own (it had been a false alarm at `scores`); keys taken from the
    queries' side, with the second sequence never read, are `wrong_source`."""
    report = check(_ExpertCross)
    assert report.ok and report.kind == "cross", report.to_text(color=False)
    bad = check(lambda: _ExpertCross(slip=True))
    assert outcome(bad) == ("keys", "wrong_source"), bad.to_text(color=False)


def test_projections_of_different_transforms_of_one_input_are_refused_if_unexplained():
    """Queries from a norm of the input, keys and values from the input as it came: not a
    reading the reference has, so a layer it cannot explain is refused, not judged."""

    class Split(_ExpertCross):
        def forward(self, x):
            b, n, _ = x.shape
            q = self.q_proj(self.norm(x)).view(b, n, 4, 8).transpose(1, 2)
            k = self.k_proj(x).view(b, n, 4, 8).transpose(1, 2)
            v = self.v_proj(x).view(b, n, 4, 8).transpose(1, 2)
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, n, 32))

    with pytest.raises(AttnScopeError, match="different transforms of the input"):
        check(Split, kind="causal-multihead")


class _TupleWindow(nn.Module):
    """OLMo-core: the configuration declares a window of 8 keys; the layer converts it to
    flash-attn's ``(left, right)``; ``left`` 8 (the slip) or 7."""

    def __init__(self, left=7):
        super().__init__()
        torch.manual_seed(40)
        self.config = SimpleNamespace(window_size=8)
        self.window_size = (left, 0)
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = (j <= i) & (i - j <= self.window_size[0])
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


def test_a_window_declared_in_keys_wins_over_the_pair_converted_from_it():
    assert check(_TupleWindow, kind="causal-multihead").ok
    bad = check(lambda: _TupleWindow(left=8), kind="causal-multihead")
    assert outcome(bad) == ("masked_scores", "window_size"), bad.to_text(color=False)


class _FullNormCut(nn.Module):
    """LLaDA: a LayerNorm over the whole query and key projections, then the heads cut
    (``slip``: queries viewed ``(B, H, T, hd)`` straight from ``(B, T, C)``), rotated."""

    def __init__(self, slip=False):
        super().__init__()
        torch.manual_seed(41)
        self.slip = slip
        self.att_proj, self.attn_out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.q_norm, self.k_norm = nn.LayerNorm(32), nn.LayerNorm(32)
        with torch.no_grad():
            for ln in (self.q_norm, self.k_norm):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.att_proj(x).split(32, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, 4, n, 8) if self.slip else q.view(b, n, 4, 8).transpose(1, 2)
        k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in (k, v))
        pos = torch.arange(n)
        y = nn.functional.scaled_dot_product_attention(_rotate(q, pos), _rotate(k, pos), v)
        return self.attn_out(y.transpose(1, 2).reshape(b, n, 32))


def test_heads_cut_wrongly_after_a_full_width_norm_are_heads_split():
    """The norm saw each token's row before the wrong cut: read so, the mistake is named
    (it had been refused as a rotation not read)."""
    assert check(_FullNormCut, kind="multihead").ok
    bad = check(lambda: _FullNormCut(slip=True), kind="multihead")
    assert outcome(bad) == ("queries", "heads_split"), bad.to_text(color=False)


def test_queries_and_keys_clipped_to_a_range_are_refused_naming_the_clip():
    class Clipped(_FullNormCut):
        def forward(self, x):
            b, n, _ = x.shape
            qkv = self.att_proj(x).clamp(min=-0.3, max=0.3)
            q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in qkv.split(32, dim=-1))
            y = nn.functional.scaled_dot_product_attention(q, k, v)
            return self.attn_out(y.transpose(1, 2).reshape(b, n, 32))

    with pytest.raises(AttnScopeError, match="clipped to a range"):
        check(Clipped, kind="multihead")


def test_a_decoding_divergence_at_a_layer_that_reads_later_tokens_names_no_cache_mistake():
    """A model whose second layer softmaxes over the queries fails there; its cached steps
    cannot equal a full pass that reads tokens still to come, and that is the layer's
    failure, not the cache's (it had been named `cache_mask`)."""

    class Leaky(_BufferLM):
        def __init__(self):
            super().__init__()
            self.layers[1].leak = True

    report = check(Leaky)
    assert outcome(report) == ("weights", "softmax_wrong_dim"), report.to_text(color=False)
    assert report.decode is not None and not report.decode.ok
    assert report.decode.mistake is None and "later tokens" in report.decode.message


# ---------------------------------------------------------------- round 31


def test_an_alibi_mask_whose_future_entries_are_zero_is_mask_fill_value():
    """Step-Audio's ``bias.masked_fill(tril == 0, 0.0)``: one additive mask of ALiBi and
    the future, its future 0 instead of -inf (it had been `context`/`other`)."""

    class ZeroFuture(_AlibiSplit):
        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.W_pack(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            bias = -(i - j) * self.slopes[:, None, None]
            bias = bias.masked_fill(j > i, 0.0)  # the slip: 0 where -inf belongs
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(x.dtype))
            return self.o_proj(y.transpose(1, 2).reshape(b, n, 64))

    report = check(ZeroFuture, kind="causal-multihead")
    assert outcome(report) == ("masked_scores", "mask_fill_value"), report.to_text(color=False)


class _PartsFirst(nn.Module):
    """VGGT's frame attention, per-head QK LayerNorm; ``slip``: the combined projection
    reshaped ``(3, B, heads, N, hd)`` with no permute."""

    def __init__(self, slip=False):
        super().__init__()
        torch.manual_seed(42)
        self.slip = slip
        self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)
        self.q_norm, self.k_norm = nn.LayerNorm(8), nn.LayerNorm(8)
        with torch.no_grad():
            for ln in (self.q_norm, self.k_norm):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        b, n, _ = x.shape
        if self.slip:
            qkv = self.qkv(x).reshape(3, b, 4, n, 8)
        else:
            qkv = self.qkv(x).reshape(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        return self.proj(y.transpose(1, 2).reshape(b, n, 32))


def test_a_combined_projection_reshaped_parts_first_under_a_qk_norm_is_heads_split():
    """The norm is read on the scrambled heads (it had been refused as a QK norm not
    read), and the reshape is named."""
    assert check(_PartsFirst, kind="multihead").ok
    bad = check(lambda: _PartsFirst(slip=True), kind="multihead")
    assert outcome(bad) == ("queries", "heads_split"), bad.to_text(color=False)


# ---------------------------------------------------------------- m26


class _FoldedGroups(nn.Module):
    """Fast-LLM's backup attention: each key/value group's query heads folded into its
    rows, ``(b*groups, tokens*heads_per_group, d)``, complex-format rotary; ``window``: the
    keys a query sees, ``wide`` one more than its configuration says."""

    def __init__(self, wide=False):
        super().__init__()
        torch.manual_seed(43)
        self.window_size, self.wide = 4, wide
        self.query, self.key_value = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
        self.dense = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.query(x).unflatten(-1, (4, 8))
        k, v = self.key_value(x).unflatten(-1, (4, 8)).chunk(2, dim=2)  # 2 groups
        ang = torch.arange(n, dtype=torch.float64)[:, None] * 1e4 ** (
            -torch.arange(0, 8, 2, dtype=torch.float64) / 8
        )
        turn = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]

        def rot(t):
            c = torch.view_as_complex(t.double().unflatten(-1, (-1, 2)).contiguous()) * turn
            return torch.view_as_real(c).flatten(-2).to(t.dtype)

        q, k = rot(q), rot(k)
        q = q.unflatten(2, (2, 2)).transpose(1, 2).reshape(b * 2, n * 2, 8)
        k, v = (t.movedim(1, 2).flatten(0, 1) for t in (k, v))
        s = torch.baddbmm(
            torch.empty(b * 2, n * 2, n), q, k.transpose(-1, -2), beta=0, alpha=8**-0.5
        )
        s = s.view(b, 2, n, 2, n)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = (j <= i) & (i - j < self.window_size + (1 if self.wide else 0))
        s = torch.where(seen[None, None, :, None, :], s, torch.finfo(s.dtype).min)
        y = torch.bmm(s.softmax(-1).view(b * 2, n * 2, n), v).view(b, 2, n, 2, 8)
        return self.dense(y.permute(0, 2, 1, 3, 4).flatten(2))


def test_query_heads_folded_into_their_groups_rows_are_read():
    """The rotation is read on queries laid out (b*groups, tokens*heads_per_group, d) (it
    had been refused as a rotation not read), and a window one key too wide is named."""
    report = check(_FoldedGroups, kind="causal-multihead")
    assert report.ok and report.structure["kv_heads"] == 2, report.to_text(color=False)
    bad = check(lambda: _FoldedGroups(wide=True), kind="causal-multihead")
    assert outcome(bad) == ("masked_scores", "window_size"), bad.to_text(color=False)
