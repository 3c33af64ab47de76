"""Readings asked for by the open cases and the first runs of rounds 22 and m15: an engine's
flattened batch ``(batch * tokens, features)`` found stage by stage; one side's positions
scaled against the other's read at a large rotary base; query heads cut wrongly in a rotated,
normed, grouped layer; keys times queries under a QK norm; a softmax scale that changes
with the length refused; ALiBi as a function of the key with a softmax over the queries;
a cache object a model hands its layers replayed as handed; and from rounds 23 and m16:
ALiBi slopes kept as a frozen parameter, a window applied after the softmax, an expert no
token is routed to, a stack of mixed block types; and from round 24: a layer that rebinds
its input before unpacking it, grouped keys cut from the query columns, projections picked
token by token; and from m18: a layer that runs only inside its model, an RMS norm written
with ``sqrt``, values made by the key projection; and from m19: a tied table looked up
transposed, an output kernel contracted over two axes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check


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


# ---------------------------------------------------------------- round 22's first run


def _interleaved(x, pos, base=1e4):
    """Adjacent pairs; ``x`` ``(..., tokens, hd)``."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class _Grouped(nn.Module):
    """Grouped heads 4/2 in a 5-D (group, heads per group) layout, per-head RMS QK norm and
    an interleaved rotation, non-causal. ``cut``: "right"; "dim_first" (queries viewed as
    ``(hd, group, hpg)``: heads cut from strided features); "hpg_first" (viewed as ``(hpg,
    group, hd)``: query head h lands in group h % 2)."""

    def __init__(self, cut="right"):
        super().__init__()
        torch.manual_seed(3)
        self.cut = cut
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
        self.o = nn.Linear(32, 32)
        self.gq = nn.Parameter(torch.rand(8) + 0.5)
        self.gk = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x)
        if self.cut == "dim_first":
            q = q.view(b, n, 8, 2, 2).permute(0, 3, 4, 1, 2)
        elif self.cut == "hpg_first":
            q = q.view(b, n, 2, 2, 8).permute(0, 3, 2, 1, 4)
        else:
            q = q.view(b, n, 2, 2, 8).permute(0, 2, 3, 1, 4)
        k = self.k(x).view(b, n, 2, 1, 8).permute(0, 2, 3, 1, 4)
        v = self.v(x).view(b, n, 2, 1, 8).permute(0, 2, 3, 1, 4)
        q = self.gq * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
        k = self.gk * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
        pos = torch.arange(n)
        q, k = _interleaved(q, pos), _interleaved(k, pos)
        y = nn.functional.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q))
        return self.o(y.permute(0, 3, 1, 2, 4).reshape(b, n, 32))


@pytest.mark.parametrize(
    "cut,want",
    [
        ("right", ("ok",)),
        # the rotation and norm are read on the heads as cut, and the cut is the mistake
        ("dim_first", ("queries", "heads_split")),
        # query head h grouped with kv head h % 2, and merged back in that order
        ("hpg_first", ("scores", "kv_group_mapping")),
    ],
)
def test_query_heads_cut_wrongly_in_a_rotated_grouped_layer_are_named(cut, want):
    report = check(lambda: _Grouped(cut), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)


class _NormedTransposed(nn.Module):
    """A full-width RMS QK norm, and the scores made keys times queries (or not)."""

    def __init__(self, transposed):
        super().__init__()
        torch.manual_seed(4)
        self.transposed = transposed
        self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)
        self.gq = nn.Parameter(torch.rand(32) + 0.5)
        self.gk = nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)

        def norm(t, g):
            flat = t.transpose(1, 2).reshape(b, n, 32)
            flat = g * flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
            return flat.view(b, n, 4, 8).transpose(1, 2)

        q, k = norm(q, self.gq), norm(k, self.gk)
        s = (k * 8**-0.5) @ q.transpose(-2, -1) if self.transposed else (q * 8**-0.5) @ k.mT
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


def test_keys_times_queries_under_a_qk_norm_is_scores_transposed():
    """The product's left operand is made from the key projection: the norm is read with
    the operands taken the other way round, and the judge names the transposition."""
    assert check(lambda: _NormedTransposed(False), kind="multihead").ok
    report = check(lambda: _NormedTransposed(True), kind="multihead")
    assert outcome(report) == ("scores", "scores_transposed"), report.to_text(color=False)


class _LengthScaled(nn.Module):
    """Proportional attention: a softmax scale of sqrt(log_16(tokens) / hd); ``fixed``: the
    same formula frozen at 7 tokens (a wrong scale, not one that moves)."""

    def __init__(self, fixed=False):
        super().__init__()
        torch.manual_seed(5)
        self.fixed = fixed
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        scale = math.sqrt(math.log(7 if self.fixed else max(n, 2), 16) / 8)
        y = nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


def test_a_scale_that_changes_with_the_length_is_refused_a_fixed_wrong_one_named():
    with pytest.raises(AttnScopeError, match="scale that changes with the sequence's length"):
        check(_LengthScaled, kind="multihead")
    report = check(lambda: _LengthScaled(fixed=True), kind="multihead")
    assert outcome(report) == ("scaled_scores", "wrong_scale"), report.to_text(color=False)


# ---------------------------------------------------------------- model round 15's first run


class _ByKeyAlibi(nn.Module):
    """Sequence-first einsum attention, ``[q, k, b, h]`` scores, ALiBi as ``slope * (j + 1)``
    (labml's: per query, a constant away from ``-slope * (i - j)``), causal; ``dim`` is the
    axis of its softmax (1: the keys; 0: the queries, a slip)."""

    def __init__(self, dim=1):
        super().__init__()
        self.dim = dim
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):  # (T, B, d)
        n, b, _ = x.shape
        q, k, v = (f(x).view(n, b, 4, 8) for f in (self.q, self.k, self.v))
        s = torch.einsum("ibhd,jbhd->ijbh", q, k) * 8**-0.5
        slopes = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
        s = s + (torch.arange(n) + 1.0)[None, :, None, None] * slopes
        keep = torch.ones(n, n, dtype=torch.bool).tril()[:, :, None, None]
        w = s.masked_fill(~keep, float("-inf")).softmax(self.dim)
        return self.o(torch.einsum("ijbh,jbhd->ibhd", w, v).reshape(n, b, 32))


class _SeqFirstModel(nn.Module):
    def __init__(self, bad_layer=None):
        super().__init__()
        torch.manual_seed(6)
        self.embed = nn.Embedding(96, 32)
        self.layers = nn.ModuleList(_ByKeyAlibi(0 if i == bad_layer else 1) for i in range(3))
        self.head = nn.Linear(32, 96)

    def forward(self, ids):
        x = self.embed(ids).transpose(0, 1)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x.transpose(0, 1))


def test_alibi_by_key_with_a_softmax_over_the_queries_is_softmax_wrong_dim():
    """A bias of the key alone cancels in a softmax over the queries, which the distance
    form does not: the reference keeps the layer's form, and the [q, k, b, h] layout of the
    scores is found."""
    assert check(_SeqFirstModel).ok
    report = check(lambda: _SeqFirstModel(bad_layer=2))
    assert report.first_layer == "layers.2"
    assert outcome(report) == ("weights", "softmax_wrong_dim"), report.to_text(color=False)
    walk = report.to_text(color=False)
    assert "queries and keys first" in walk


class _LayerCache:
    """A per-layer cache object the model hands each layer (llama-burn's): the layer appends
    its keys and values to it."""

    def __init__(self):
        self.k = self.v = None

    def add(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.k, self.v


class _CachedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x, cache):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        k, v = cache.add(k, v)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


class _CacheObjectModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(96, 32)
        self.layers = nn.ModuleList(_CachedLayer() for _ in range(2))
        self.head = nn.Linear(32, 96)

    def forward(self, ids):
        caches = [_LayerCache() for _ in self.layers]  # a fresh cache for every call
        x = self.embed(ids)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = x + layer(x, cache)
        return self.head(x)


def test_a_cache_object_handed_to_a_layer_is_replayed_as_it_was_handed():
    """Every probe of a layer gets the model's cache object as the model handed it (empty),
    not as the previous probe left it (its keys joined to every later call's)."""
    report = check(_CacheObjectModel)
    assert report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["layers.0", "layers.1"]


# ---------------------------------------------------------------- rounds 23 and m16's first runs


class _FrozenSlopes(nn.Module):
    """ALiBi whose slopes are kept as a frozen parameter (BTLM's ``requires_grad=False``),
    causal; ``sign`` -1 flips the bias (favours distant keys: bias_sign)."""

    def __init__(self, learned=False, sign=1.0):
        super().__init__()
        torch.manual_seed(8)
        self.sign = sign
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)
        slopes = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])[:, None, None]
        self.slopes = nn.Parameter(slopes, requires_grad=learned)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n)
        bias = -self.sign * self.slopes * (pos[:, None] - pos[None, :]).abs()
        s = q @ k.mT * 8**-0.5 + bias
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


def test_alibi_slopes_kept_as_a_frozen_parameter_are_alibi_trainable_ones_a_learned_bias():
    report = check(_FrozenSlopes, kind="causal-multihead")
    assert report.ok and report.structure["bias"] == "alibi", report.to_text(color=False)
    flipped = check(lambda: _FrozenSlopes(sign=-1.0), kind="causal-multihead")
    assert outcome(flipped) == ("biased_scores", "bias_sign"), flipped.to_text(color=False)
    # trainable slopes: a learned relative bias, taken as the layer computes it (round 38)
    learned = check(lambda: _FrozenSlopes(learned=True), kind="causal-multihead")
    assert learned.ok and learned.structure["bias"] == "learned", learned.to_text(color=False)


class _WindowZeroed(nn.Module):
    """A sliding window of 3 (declared), the mask applied after the softmax: probabilities
    outside the window zeroed, rows not renormalised (or, ``right``, before the softmax)."""

    def __init__(self, right=False):
        super().__init__()
        torch.manual_seed(9)
        self.right, self.sliding_window = right, 3
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & (i - j < self.sliding_window)
        s = q @ k.mT * 8**-0.5
        if self.right:
            w = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        else:
            w = s.softmax(-1) * allowed
        return self.o((w @ v).transpose(1, 2).reshape(b, n, 32))


def test_a_window_applied_to_the_weights_after_the_softmax_is_mask_after_softmax():
    assert check(lambda: _WindowZeroed(right=True), kind="causal-multihead").ok
    report = check(_WindowZeroed, kind="causal-multihead")
    assert outcome(report) == ("weights", "mask_after_softmax"), report.to_text(color=False)


class _TwoExperts(nn.Module):
    """CogVLM's expert attention: image tokens and text tokens projected by weights of their
    own, routed by a token-type mask; ``image`` marks how many leading tokens are image
    tokens (0: text only, the vision expert projects no token)."""

    def __init__(self, image=0):
        super().__init__()
        torch.manual_seed(10)
        self.image = image
        self.text_qkv, self.image_qkv = nn.Linear(32, 96), nn.Linear(32, 96)
        self.o = nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        is_image = torch.zeros(b, n, dtype=torch.bool)
        is_image[:, : self.image] = True
        qkv = x.new_zeros(b, n, 96)
        qkv[is_image] = self.image_qkv(x[is_image])
        qkv[~is_image] = self.text_qkv(x[~is_image])
        q, k, v = qkv.view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


def test_an_expert_no_token_is_routed_to_is_no_second_projection():
    """Text only, the image expert projects an empty selection: one attention, judged;
    with image tokens routed to it, a multiway layer, refused."""
    assert check(_TwoExperts, kind="causal-multihead").ok
    with pytest.raises(AttnScopeError, match="multiway"):
        check(lambda: _TwoExperts(image=2), kind="causal-multihead")


class _OwnAttention(nn.Module):
    """A block type of the tower's own, with nn.MultiheadAttention's parameters, handed no
    mask (the slip: its block drops the causal mask it was given)."""

    def __init__(self):
        super().__init__()
        self.in_proj_weight = nn.Parameter(torch.randn(96, 32) * 0.2)
        self.in_proj_bias = nn.Parameter(torch.zeros(96))
        self.out_proj = nn.Linear(32, 32)

    def forward(self, x, attn_mask=None):
        b, n, _ = x.shape
        q, k, v = nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.out_proj(y.transpose(1, 2).reshape(b, n, 32))


class _MixedTower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(96, 32)
        self.blocks = nn.ModuleList(
            [nn.MultiheadAttention(32, 4, batch_first=True) for _ in range(2)] + [_OwnAttention()]
        )
        self.head = nn.Linear(32, 96)

    def forward(self, ids):
        n = ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        x = self.embed(ids)
        for block in self.blocks:
            if isinstance(block, nn.MultiheadAttention):
                x = x + block(x, x, x, attn_mask=mask, need_weights=False)[0]
            else:
                x = x + block(x)  # the mask dropped
        return self.head(x)


def test_a_stack_of_mixed_block_types_is_one_kind_when_inferred():
    """Blocks at the same place with the same parameters are one stack whatever their
    class: its causal layers make the one handed no mask a causal layer missing it."""
    report = check(_MixedTower)
    assert report.first_layer == "blocks.2"
    assert outcome(report) == ("masked_scores", "missing_mask"), report.to_text(color=False)


# ---------------------------------------------------------------- round 24's first run


class _RebindsItsInput(nn.Module):
    """TeleChat's layer: takes (batch, tokens, d), turns it sequence-first itself, then
    unpacks ``q_len, bsz, _ = hidden_states.shape``: not a layer that takes (tokens, batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(12)
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, hidden_states):
        hidden_states = hidden_states.transpose(1, 0)
        q_len, bsz, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(q_len, bsz, 3, 4, 8).permute(2, 1, 3, 0, 4)
        pos = torch.arange(q_len)
        q, k = _rotate(q, pos, 1e4), _rotate(k, pos, 1e4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(bsz, q_len, 32))


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _RebindsItsInput()

    def forward(self, x):
        return x + self.attn(x)


def test_a_layer_that_rebinds_its_input_before_unpacking_it_is_batch_first():
    report = check(_Outer)
    assert report.ok, report.to_text(color=False)
    assert report.structure["rope"] is not None


class _PackedOffset(nn.Module):
    """ONNX Runtime's packed QKV, grouped heads 4/2, rotated; ``slip``: the keys sliced
    from offset 0 (the query projection's first key-width columns)."""

    def __init__(self, slip=False):
        super().__init__()
        torch.manual_seed(13)
        self.slip = slip
        self.qkv_proj, self.o_proj = nn.Linear(32, 64, bias=False), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        packed = self.qkv_proj(x)
        q = packed[..., :32]
        k = packed[..., :16] if self.slip else packed[..., 32:48]
        v = packed[..., 48:]
        q = q.view(b, n, 4, 8).transpose(1, 2)
        k, v = (t.view(b, n, 2, 8).transpose(1, 2) for t in (k, v))
        pos = torch.arange(n)
        q, k = _rotate(q, pos, 1e4), _rotate(k, pos, 1e4)
        y = nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, n, 32))


def test_grouped_keys_cut_from_the_query_columns_are_wrong_projection():
    assert check(_PackedOffset, kind="causal-multihead").ok
    report = check(lambda: _PackedOffset(slip=True), kind="causal-multihead")
    assert outcome(report) == ("keys", "wrong_projection"), report.to_text(color=False)


class _TokenTypeExperts(nn.Module):
    """CogVLM's visual expert: every token projected by both experts, a ``where`` picking
    the image expert's output for image tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(14)
        self.vision_qkv, self.language_qkv = nn.Linear(32, 96), nn.Linear(32, 96)
        self.o = nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        image = (torch.arange(n) < n // 2)[None, :, None]
        qkv = torch.where(image, self.vision_qkv(x), self.language_qkv(x))
        q, k, v = qkv.view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


def test_projections_picked_token_by_token_are_refused_naming_them():
    with pytest.raises(AttnScopeError, match="token-type experts"):
        check(_TokenTypeExperts, kind="causal-multihead")


# ---------------------------------------------------------------- model round 18's first run

_CONTEXT = {}  # a global context the model's forward sets around its layers (nano-vllm's)


class _ContextLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        lens = _CONTEXT["lens"]  # raises called on its own: the model sets it
        b, n, _ = x.shape
        assert lens == [n] * b
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


class _ContextModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(15)
        self.embed = nn.Embedding(96, 32)
        self.layers = nn.ModuleList(_ContextLayer() for _ in range(2))
        self.head = nn.Linear(32, 96)

    def forward(self, ids):
        _CONTEXT["lens"] = [ids.shape[1]] * ids.shape[0]
        try:
            x = self.embed(ids)
            for layer in self.layers:
                x = x + layer(x)
            return self.head(x)
        finally:
            _CONTEXT.clear()


def test_a_layer_that_runs_only_inside_its_model_is_probed_there():
    report = check(_ContextModel)
    assert report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["layers.0", "layers.1"]


class _SqrtNormValuesFromKeys(nn.Module):
    """A per-head RMS QK norm written ``x / sqrt(mean(x²) + eps)``, rotated, grouped 4/2;
    ``slip``: the values are the keys' projection (``value_states = key_states``) while
    ``v_proj`` sits idle."""

    def __init__(self, slip=False):
        super().__init__()
        torch.manual_seed(16)
        self.slip = slip
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(32, 32),
            nn.Linear(32, 16),
            nn.Linear(32, 16),
        )
        self.o_proj = nn.Linear(32, 32)
        self.gq, self.gk = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, 4, 8).transpose(1, 2)
        k = self.k_proj(x)
        v = k if self.slip else self.v_proj(x)
        k, v = (t.view(b, n, 2, 8).transpose(1, 2) for t in (k, v))

        def rms(t, g):
            return g * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

        pos = torch.arange(n)
        q, k = _rotate(rms(q, self.gq), pos, 1e4), _rotate(rms(k, self.gk), pos, 1e4)
        y = nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, n, 32))


def test_an_rms_norm_written_with_sqrt_is_read_and_values_from_the_keys_named():
    report = check(_SqrtNormValuesFromKeys, kind="causal-multihead")
    assert report.ok and report.structure["qk_norm"] == "per-head", report.to_text(color=False)
    slip = check(lambda: _SqrtNormValuesFromKeys(slip=True), kind="causal-multihead")
    assert outcome(slip) == ("values", "wrong_projection"), slip.to_text(color=False)


# ---------------------------------------------------------------- model round 19's first run


class _DenseGeneral(nn.Module):
    """flax's DenseGeneral: a kernel of shape in_shape + out_shape, applied by tensordot."""

    def __init__(self, in_shape, out_shape):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(*in_shape, *out_shape) / math.prod(in_shape) ** 0.5)
        self.n_in = len(in_shape)

    def forward(self, x):
        dims = list(range(x.dim() - self.n_in, x.dim()))
        return torch.tensordot(x, self.kernel, dims=(dims, list(range(self.n_in))))


class _FlaxAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (_DenseGeneral((32,), (4, 8)) for _ in range(3))
        self.out = _DenseGeneral((4, 8), (32,))  # contracts two axes: heads and head_dim

    def forward(self, x):
        q, k, v = self.query(x) / 8**0.5, self.key(x), self.value(x)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k)
        n = x.shape[1]
        s = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), s, torch.tensor(-1e30))
        return self.out(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v))


class _TiedTableModel(nn.Module):
    """Praxis's shared embedding: the ids look up rows of the output weight transposed
    (``w.t()[ids]``), no ``nn.Embedding``; its layers project with 2-axis tensordots."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(17)
        self.w = nn.Parameter(torch.randn(32, 96) * 0.2)  # (d, vocab)
        self.layers = nn.ModuleList(_FlaxAttention() for _ in range(2))

    def forward(self, ids):
        x = self.w.t()[ids]
        for layer in self.layers:
            x = x + layer(x)
        return x @ self.w


def test_a_tied_table_transposed_gives_the_vocabulary_and_a_two_axis_output_kernel_is_read():
    """Without its output kernel ``(heads, hd, d)`` read (a tensordot over two axes) every
    correct layer had been an `output` false alarm."""
    report = check(_TiedTableModel)
    assert report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["layers.0", "layers.1"]


# ---------------------------------------------------------------- round 27's first run


class _RotationTables(nn.Module):
    """BLT's rotary: a buffer of 2 x 2 rotation matrices per position and pair, ``(T, d/2,
    2, 2)``; a model whose ``attn_bias_type`` is ``"causal"`` (a global layer) beside a
    window length it keeps for its local layers, or ``"local_block_causal"`` with a mask of
    ``window + extra`` keys (``extra`` 1: a window one key too wide)."""

    def __init__(self, bias_type="causal", extra=0):
        super().__init__()
        torch.manual_seed(18)
        self.attn_bias_type, self.sliding_window, self.extra = bias_type, 8, extra
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)
        ang = torch.arange(64, dtype=torch.float64)[:, None] * 1e4 ** (
            -torch.arange(0, 8, 2, dtype=torch.float64) / 8
        )
        rot = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).view(64, 4, 2, 2)
        self.register_buffer("freqs_cis", rot, persistent=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        rot = self.freqs_cis[:n].to(x.dtype)

        def turn(t):  # the halves pairing, with the matrices' cos and sin
            cos, sin = rot[..., 0, 0], rot[..., 1, 0]  # (tokens, hd / 2)
            a, b = t[..., :4], t[..., 4:]
            return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)

        q, k = turn(q), turn(k)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = j <= i
        if self.attn_bias_type != "causal":
            allowed = allowed & (i - j < self.sliding_window + self.extra)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


def test_rotation_matrix_tables_do_not_cap_the_probe_and_a_causal_type_is_global():
    """The 2 x 2 matrices are no causal mask sized for the longest input: the probe is
    longer than the window, which a local layer one key too wide then shows; a layer whose
    type names no window is a global one, not a window missing."""
    glob = check(_RotationTables, kind="causal-multihead")
    assert glob.ok and glob.structure["window"] is None, glob.to_text(color=False)
    local = check(lambda: _RotationTables("local_block_causal"), kind="causal-multihead")
    assert local.ok and local.structure["window"] == 8, local.to_text(color=False)
    wide = check(lambda: _RotationTables("local_block_causal", 1), kind="causal-multihead")
    assert outcome(wide) == ("masked_scores", "window_size"), wide.to_text(color=False)


class _KeysFromValues(nn.Module):
    """A fused split unpacked as (query, value, key): keys from the value columns, rotated."""

    def __init__(self, slip=False):
        super().__init__()
        torch.manual_seed(19)
        self.slip = slip
        self.c_attn, self.c_proj = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.c_attn(x).split(32, dim=-1)
        if self.slip:
            q, v, k = self.c_attn(x).split(32, dim=-1)
        q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(n)
        q, k = _rotate(q, pos, 1e4), _rotate(k, pos, 1e4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, n, 32))


def test_rotated_keys_made_with_the_value_columns_are_wrong_projection():
    assert check(_KeysFromValues, kind="causal-multihead").ok
    report = check(lambda: _KeysFromValues(slip=True), kind="causal-multihead")
    assert report.first_failure.mistake == "wrong_projection", report.to_text(color=False)
