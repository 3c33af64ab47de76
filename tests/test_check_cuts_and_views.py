"""Layouts read from what the computation does (round 8): a combined projection cut into
model-parallel chunks, complex scores, grouped heads on two axes, a KV cache read whole,
a causal window wider than the first probe, and a model that masks the future only when
handed a padding mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _interleaved(n: int, dim: int, base: float = 10000.0, start: int = 0):
    """cos, sin ``(n, dim)`` laid out for adjacent pairs."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2).double() / dim)
    ang = torch.outer(torch.arange(start, start + n).double(), inv)
    return ang.cos().repeat_interleave(2, -1).float(), ang.sin().repeat_interleave(2, -1).float()


class _Chunked(nn.Module):
    """CodeGen's fused projection: ``chunks`` model-parallel chunks, each holding the blocks
    of its heads in ``order`` (CodeGen: query, value, key), adjacent-pair rotation."""

    def __init__(self, order="qvk", chunks=2, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.order, self.chunks, self.h, self.hd = order, chunks, heads, d // heads
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv_proj(x).reshape(b, n, self.chunks, -1)
        parts = dict(zip(self.order, torch.split(qkv, d // self.chunks, dim=-1), strict=True))
        q, k, v = (parts[r].reshape(b, n, self.h, self.hd).transpose(1, 2) for r in "qkv")
        cos, sin = _interleaved(n, self.hd)
        q, k = (t * cos + _rotate_every_two(t) * sin for t in (q, k))
        w = (q @ k.transpose(-1, -2) / math.sqrt(self.hd)).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
        )
        return self.out_proj((w.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("order", ["qvk", "qkv"])
def test_model_parallel_chunks_are_cut_where_the_computation_cuts_them(order):
    """Two chunks of [q|v|k] (or [q|k|v]) blocks: neither the blocks layout nor the per-head
    one, read from the layout calls that cut the projection."""
    report = check(lambda: _Chunked(order), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["rope"]["pairing"] == "interleaved"


def test_queries_cut_where_the_keys_belong_stay_a_mistake():
    """Keys cut where each chunk's queries are: not a published layout, so not a reading
    that passes (refused, or a failure, never correct)."""
    try:
        report = check(lambda: _Chunked("kqv"), kind="causal-multihead")
    except AttnScopeError as exc:
        assert "not supported yet" in str(exc)
    else:
        assert not report.ok


class _ComplexScores(nn.Module):
    """Queries and keys as complex pairs, scores as the real part of their product: the dot
    product when one side is conjugated."""

    def __init__(self, conj: bool, einsum: bool = False, d=32, heads=4):
        super().__init__()
        torch.manual_seed(1)
        self.conj, self.einsum, self.h, self.hd = conj, einsum, heads, d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            w(x).view(b, n, self.h, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        cos, sin = _interleaved(n, self.hd)
        q, k = (t * cos + _rotate_every_two(t) * sin for t in (q, k))
        qc = torch.view_as_complex(q.reshape(b, self.h, n, -1, 2).contiguous())
        kc = torch.view_as_complex(k.reshape(b, self.h, n, -1, 2).contiguous())
        if self.einsum:  # the conjugate on the queries' side: the same dot product
            qc = qc.conj() if self.conj else qc
            s = torch.einsum("bhtd,bhsd->bhts", qc, kc).real / math.sqrt(self.hd)
        else:
            kc = kc.conj() if self.conj else kc
            s = (qc @ kc.transpose(-1, -2)).real / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.wo((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("einsum", [False, True])
@pytest.mark.parametrize("conj,want", [(True, ("ok",)), (False, ("scores", "not_dot_product"))])
def test_complex_scores_are_read_through_the_tensors_they_view(conj, want, einsum):
    report = check(lambda: _ComplexScores(conj, einsum), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.structure["head_dim"] == 8


class _GroupedEinsum(nn.Module):
    """Grouped heads kept on two axes (``btkgd,bskd->bkgts``), halves rotation; ``shift``
    rotates the keys that many positions ahead of the queries."""

    def __init__(self, shift=0, d=32, heads=4, kv=2):
        super().__init__()
        torch.manual_seed(2)
        self.shift, self.h, self.kv, self.hd = shift, heads, kv, d // heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk, self.wv = nn.Linear(d, kv * self.hd, bias=False), nn.Linear(d, kv * self.hd)
        self.wo = nn.Linear(d, d, bias=False)

    def _rope(self, x, start):
        half = self.hd // 2
        inv = 1.0 / 10000 ** (torch.arange(half).double() * 2 / self.hd)
        ang = torch.outer(torch.arange(start, start + x.shape[1]).double(), inv).float()
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, x):
        b, n, _ = x.shape
        q = self._rope(self.wq(x).view(b, n, self.h, self.hd), 0)
        k = self._rope(self.wk(x).view(b, n, self.kv, self.hd), self.shift)
        v = self.wv(x).view(b, n, self.kv, self.hd)
        q = q.view(b, n, self.kv, self.h // self.kv, self.hd)
        s = torch.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ctx = torch.einsum("bkgts,bskd->btkgd", s.softmax(-1), v)
        return self.wo(ctx.reshape(b, n, -1))


@pytest.mark.parametrize("shift,want", [(0, ("ok",)), (1, ("rotated_keys", "rope_positions"))])
def test_grouped_heads_on_two_axes_are_read_as_heads(shift, want):
    report = check(lambda: _GroupedEinsum(shift), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if want == ("ok",):
        assert (report.structure["heads"], report.structure["kv_heads"]) == (4, 2)


class _Cached(nn.Module):
    """A layer whose forward writes its keys and values into a preallocated cache and
    attends over all of it (gpt-fast's static KVCache), rotated by position."""

    def __init__(self, d=32, heads=4, max_seq=24):
        super().__init__()
        torch.manual_seed(3)
        self.h, self.hd = heads, d // heads
        self.wqkv, self.wo = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.register_buffer("k_cache", torch.zeros(4, heads, max_seq, self.hd))
        self.register_buffer("v_cache", torch.zeros(4, heads, max_seq, self.hd))
        self.register_buffer("mask", torch.ones(max_seq, max_seq, dtype=torch.bool).tril())

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.h, self.hd).transpose(1, 2) for t in self.wqkv(x).split(d, -1))
        cos, sin = _interleaved(n, self.hd)
        q, k = (t * cos + _rotate_every_two(t) * sin for t in (q, k))
        pos = torch.arange(n)
        self.k_cache[:b, :, pos] = k
        self.v_cache[:b, :, pos] = v
        y = F.scaled_dot_product_attention(
            q, self.k_cache[:b], self.v_cache[:b], attn_mask=self.mask[None, None, pos]
        )
        return self.wo(y.transpose(1, 2).reshape(b, n, d))


def test_a_kv_cache_read_whole_is_refused_naming_the_cache():
    with pytest.raises(AttnScopeError, match="not supported yet: a KV cache its forward"):
        check(_Cached, kind="causal-multihead")


class _Context(nn.Module):
    """Causal attention limited to the last ``context`` steps, the mask built from position
    deltas (Moshi), wider than the first probe; no window named in any configuration."""

    def __init__(self, context=12, d=32, heads=4):
        super().__init__()
        torch.manual_seed(4)
        self.steps, self.h, self.hd = context, heads, d // heads
        self.in_proj, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.in_proj(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n)
        delta = pos[:, None] - pos[None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=(delta >= 0) & (delta < self.steps))
        return self.out_proj(y.transpose(1, 2).reshape(b, n, d))


def test_a_causal_window_wider_than_the_probe_is_read_from_a_longer_call():
    report = check(_Context)
    assert report.ok, report.to_text(color=False)
    assert report.kind == "causal-multihead"
    assert report.structure["window"] == 12


class _MaskTaker(nn.Module):
    """Attention that applies the mask it is handed and asks for none of its own."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


class _PaddedBody(nn.Module):
    """A model body that takes an optional padding mask and builds its layer's mask from it:
    with ``decoder`` the future hidden as well (Arcee), only when a mask is given."""

    def __init__(self, decoder: bool):
        super().__init__()
        torch.manual_seed(5)
        self.decoder, self.attn = decoder, _MaskTaker()

    def forward(self, x, attention_mask=None):
        n = x.shape[1]
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, None, None].bool()
            if self.decoder:
                mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
        return x + self.attn(x, mask)


@pytest.mark.parametrize(
    "decoder,want", [(True, ("masked_scores", "missing_mask")), (False, ("ok",))]
)
def test_a_model_that_masks_the_future_given_a_padding_mask_is_a_decoder(decoder, want):
    """With the kind inferred: a padding mask that pads nothing changes nothing in an
    encoder; a model that then masks the future is a decoder, and its mask-free path that
    leaves the causal mask out is the mistake."""
    report = check(lambda: _PaddedBody(decoder))
    assert outcome(report) == want, report.to_text(color=False)
    assert report.kind == ("causal-multihead" if decoder else "multihead")


class _FusedCut(nn.Module):
    """One combined projection cut into heads: right (tokens, then heads), or reshaped
    heads-first straight from ``(B, T, 3*D)`` (per-head ``[q|k|v]`` columns chunked on the
    last axis, or ``[q|k|v]`` blocks unbound from a ``(B, 3, H, T, hd)`` view)."""

    def __init__(self, packing: str, wrong: bool, d=32, heads=4):
        super().__init__()
        torch.manual_seed(3)
        self.packing, self.wrong, self.h = packing, wrong, heads
        self.qkv_proj = nn.Linear(d, 3 * d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv_proj(x)
        if self.packing == "per-head":
            shape = (b, self.h, n, -1) if self.wrong else (b, n, self.h, -1)
            qkv = qkv.reshape(shape)
            q, k, v = (qkv if self.wrong else qkv.transpose(1, 2)).chunk(3, -1)
        else:
            shape = (b, 3, self.h, n, -1) if self.wrong else (b, n, 3, self.h, -1)
            qkv = qkv.reshape(shape)
            q, k, v = (qkv if self.wrong else qkv.permute(0, 2, 3, 1, 4)).unbind(1)
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("packing", ["per-head", "blocks"])
def test_a_combined_projection_reshaped_heads_first_is_a_heads_split(packing):
    """Reshaping the combined output heads-first mixes tokens into q, k and v at once: the
    first failure is the queries' split (round 11, b16); the right cut passes."""
    assert check(lambda: _FusedCut(packing, False), kind="multihead").ok
    report = check(lambda: _FusedCut(packing, True), kind="multihead")
    assert outcome(report) == ("queries", "heads_split"), report.to_text(color=False)
