"""Projections read from what the computation does, in styles that hide them: keys written
in place through a view of a fused tensor, one fused weight that also makes a feed-forward
branch, a low-rank adapter added to a projection, a second sequence read only for its
shape. Small synthetic layers, each with its correct twin: the reading that lets the
mistake be named must leave correct code alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check


def _tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10_000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Halves pairing, written into ``x`` (which may be a view of a larger tensor)."""
    r = cos.shape[-1]
    x1, x2 = x[..., :r], x[..., r : 2 * r]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    x[..., :r] = o1
    x[..., r : 2 * r] = o2


class _FlatInPlace(nn.Module):
    """Flattened (batch*tokens, d) tokens; one fused weight split into q and a stacked kv;
    the rotation written in place into ``torch.select(kv, 1, 0)`` (TGI's style), so the
    keys are only ever read back from ``kv``."""

    def __init__(self, rotate_keys: bool, d: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.rotate_keys = rotate_keys

    def forward(self, x):
        b, n, d = x.shape
        flat = x.reshape(b * n, d)
        q, kv = self.qkv(flat).split([self.h * self.hd, 2 * self.kv * self.hd], dim=1)
        q = q.view(-1, self.h, self.hd).clone()
        kv = kv.view(-1, 2, self.kv, self.hd).clone()
        cos, sin = _tables(n, self.hd)
        cos, sin = cos.repeat(b, 1)[:, None], sin.repeat(b, 1)[:, None]
        _rotate_in_place(q, cos, sin)
        if self.rotate_keys:
            _rotate_in_place(torch.select(kv, dim=1, index=0), cos, sin)
        g = self.h // self.kv
        qs = q.view(b, n, self.h, self.hd).transpose(1, 2)
        ks = kv[:, 0].view(b, n, self.kv, self.hd).transpose(1, 2).repeat_interleave(g, 1)
        vs = kv[:, 1].view(b, n, self.kv, self.hd).transpose(1, 2).repeat_interleave(g, 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b * n, d)).view(b, n, d)


@pytest.mark.parametrize(
    "rotate_keys,want", [(True, ("ok",)), (False, ("rotated_keys", "rope_missing"))]
)
def test_keys_rotated_in_place_through_a_view_of_a_fused_tensor(rotate_keys, want):
    """An in-place write into a view changes the tensor it views: what is read from that
    tensor afterwards is made from the write (the keys are found, and their rotation)."""
    report = check(lambda: _FlatInPlace(rotate_keys), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if rotate_keys:
        assert report.structure["kv_heads"] == 2


class _ParallelBlock(nn.Module):
    """A PaLM-style parallel block computed inline: one fused weight makes the queries, one
    key head, one value head and the feed-forward input (``order`` says how its pieces
    are laid out and unpacked)."""

    def __init__(self, order=("q", "k", "v", "ff"), unpack=None, d=32, heads=4):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.sizes = {"q": d, "k": self.hd, "v": self.hd, "ff": 2 * d}
        self.order, self.unpack = order, unpack or order
        self.norm = nn.LayerNorm(d)
        self.fused = nn.Linear(d, sum(self.sizes.values()), bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_out = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.norm(x)
        pieces = self.fused(h).split([self.sizes[r] for r in self.order], dim=-1)
        got = dict(zip(self.unpack, pieces, strict=True))
        q = got["q"].view(b, n, self.h, self.hd).transpose(1, 2)
        k, v = got["k"], got["v"]
        s = torch.einsum("bhid,bjd->bhij", q, k) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ctx = torch.einsum("bhij,bjd->bhid", s.softmax(-1), v)
        attn = self.attn_out(ctx.transpose(1, 2).reshape(b, n, -1))
        return x + attn + self.ff_out(F.gelu(got["ff"]))


@pytest.mark.parametrize(
    "order,unpack,want",
    [
        (("q", "k", "v", "ff"), None, ("ok",)),
        (("ff", "q", "k", "v"), None, ("ok",)),
        (("q", "k", "v", "ff"), ("q", "v", "k", "ff"), ("keys", "wrong_projection")),
    ],
)
def test_one_fused_weight_for_multi_query_attention_and_the_feed_forward(order, unpack, want):
    """The attention's columns of the weight are the ones that reach the scores and context
    products; within them the usual [q|k|v] convention, so a swapped unpacking shows."""
    report = check(lambda: _ParallelBlock(order, unpack), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if want == ("ok",):
        assert (report.structure["heads"], report.structure["kv_heads"]) == (4, 1)


class _Adapted(nn.Module):
    """q/k/v = a projection plus a low-rank adapter (``W x + B(A(x))``, LoRA); ``peft``:
    as PEFT writes it, the adapter's input through dropout and its output times
    ``alpha / rank`` (a float on one side, a one-element tensor divided on the other)."""

    def __init__(self, scaled: bool, d: int = 32, heads: int = 4, rank: int = 4, peft=False):
        super().__init__()
        self.h, self.hd, self.scaled, self.peft = heads, d // heads, scaled, peft
        self.drop = nn.Dropout(0.1)
        self.register_buffer("rank", torch.tensor(float(rank)))
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.adapters = nn.ModuleList(
            nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, d, bias=False))
            for _ in range(3)
        )
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, n, _ = x.shape

        def adapted(proj, ad):
            if not self.peft:
                return proj(x) + ad(x)
            if proj is self.k:  # a one-element tensor divided: still one factor
                return ad(self.drop(x)) / self.rank + proj(x)
            return proj(x) + ad(self.drop(x)) * 2.0

        q, k, v = (
            adapted(proj, ad).view(b, n, self.h, self.hd).transpose(1, 2)
            for proj, ad in zip((self.q, self.k, self.v), self.adapters, strict=True)
        )
        s = q @ k.transpose(-2, -1)
        if self.scaled:
            s = s / math.sqrt(self.hd)
        ctx = s.softmax(-1) @ v
        return self.o(ctx.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("peft", [False, True])
@pytest.mark.parametrize(
    "scaled,want", [(True, ("ok",)), (False, ("scaled_scores", "missing_scale"))]
)
def test_a_projection_plus_a_low_rank_adapter_is_one_projection(scaled, want, peft):
    """A projection applied to another's whole output is one projection; two projections
    of one input added are one: their weights composed and summed, a constant factor on
    one of them and a dropout before it included (it was refused as widths that do not
    compose before)."""
    report = check(lambda: _Adapted(scaled, peft=peft), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if peft and scaled:
        assert "lora" not in report.structure  # nothing to report beyond heads
        assert report.structure["heads"] == 4


def test_an_adapter_scaled_by_something_the_input_makes_is_not_one_projection():
    """A factor that varies with the input (a gate) makes the sum no projection: the
    layer is refused, not judged as if the factor were constant."""

    class Gated(_Adapted):
        def forward(self, x):
            b, n, _ = x.shape
            gate = x.mean(-1, keepdim=True).sigmoid()
            q = (self.q(x) + self.adapters[0](x) * gate).view(b, n, self.h, self.hd)
            k = self.k(x).view(b, n, self.h, self.hd)
            v = self.v(x).view(b, n, self.h, self.hd)
            s = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(self.hd)
            ctx = s.softmax(-1) @ v.transpose(1, 2)
            return self.o(ctx.transpose(1, 2).reshape(b, n, -1))

    with pytest.raises(AttnScopeError, match="not supported yet"):
        check(lambda: Gated(True), kind="multihead")


class _CrossNormed(nn.Module):
    """Cross-attention with a per-head LayerNorm on queries and keys; ``from_x``: the fused
    key/value projection fed the queries' input, the text states read for their shape."""

    def __init__(self, from_x: bool, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd, self.from_x = heads, d // heads, from_x
        self.q_proj, self.kv_proj = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.q_norm, self.k_norm = nn.LayerNorm(self.hd), nn.LayerNorm(self.hd)
        with torch.no_grad():
            for ln in (self.q_norm, self.k_norm):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.2, 0.2)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x, text_states):
        b, s1, _ = x.shape
        _, s2, _ = text_states.shape
        src, s = (x, s1) if self.from_x else (text_states, s2)
        q = self.q_norm(self.q_proj(x).view(b, s1, self.h, self.hd)).transpose(1, 2)
        k, v = self.kv_proj(src).view(b, s, 2, self.h, self.hd).unbind(2)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        w = (q @ k.transpose(-2, -1) / math.sqrt(self.hd)).softmax(-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, s1, -1))


@pytest.mark.parametrize("kind", ["cross", None])
@pytest.mark.parametrize("from_x", [False, True])
def test_keys_from_the_queries_input_behind_a_qk_norm(from_x, kind):
    """The norm is read on the keys the layer made, from whichever input; the source is
    then judged. Inferred: a second sequence read only for its shape is not read, and its
    name says it is another sequence."""
    report = check(lambda: _CrossNormed(from_x), kind=kind)
    want = ("keys", "wrong_source") if from_x else ("ok",)
    assert outcome(report) == want, report.to_text(color=False)
    assert report.kind == "cross"


class _QueriesOfTwoInputs(nn.Module):
    """Queries made by two projections of inputs of different widths, added."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.q, self.q_wide = nn.Linear(d, d), nn.Linear(2 * d, d)
        self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x) + self.q_wide(torch.cat([x, x.flip(1)], -1))
        q, k, v = (t.view(b, n, self.h, self.hd).transpose(1, 2) for t in (q, self.k(x), self.v(x)))
        w = (q @ k.transpose(-2, -1) / math.sqrt(self.hd)).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, -1))


def test_a_role_made_by_projections_of_inputs_of_different_widths_is_refused():
    """Not a crash: refused, naming the projections."""
    with pytest.raises(AttnScopeError, match="not supported yet: the queries made by"):
        check(_QueriesOfTwoInputs, kind="multihead")


class _Packed(nn.Module):
    """The whole batch packed into one sequence (1, B*N, H, D), a block-diagonal additive
    bias keeping each sequence to its own keys (PixArt's xformers BlockDiagonalMask);
    ``blocks``: one per sequence ("batch"), none, or misaligned with the sequences."""

    def __init__(self, blocks: str, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd, self.blocks = heads, d // heads, blocks
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, c = x.shape
        q = self.q(x).view(1, -1, self.h, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(1, -1, 2, self.h, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        seq = torch.arange(b * n) // (n if self.blocks == "batch" else n + 1)
        bias = torch.zeros(b * n, b * n)
        if self.blocks != "none":
            bias = bias.masked_fill(seq[:, None] != seq[None, :], float("-inf"))
        s = q @ k.transpose(-2, -1) / math.sqrt(self.hd) + bias
        out = (s.softmax(-1) @ v).transpose(1, 2)
        return self.o(out.reshape(b, n, c))


@pytest.mark.parametrize("blocks,want", [("batch", ("ok",)), ("none", ("scores", "batch_mixing"))])
def test_a_batch_packed_into_one_sequence_with_a_block_diagonal_mask(blocks, want):
    """A mask that hides exactly the cells between the packed sequences is the packing,
    not a pattern of the layer's own; without it, sequences attend to each other."""
    report = check(lambda: _Packed(blocks), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)


def test_a_block_diagonal_mask_misaligned_with_the_packed_sequences_is_batch_mixing():
    """Blocks one token longer than the sequences: the first token of each sequence but the
    first sees the one before's keys. Where that very mask reproduces the output, the
    sequences mixing is the mistake (it had been refused as a pattern of its own)."""
    report = check(lambda: _Packed("misaligned"), kind="multihead")
    assert outcome(report) == ("scores", "batch_mixing"), report.to_text(color=False)
    assert "packed into one sequence" in report.first_failure.message


class _BatchManyChunks(nn.Module):
    """Not packed: (B, H, N, N) scores, each sequence cut into as many bidirectional chunks
    as the batch has sequences (a designed pattern, whatever the batch size)."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (t.view(b, n, self.h, self.hd).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        chunk = torch.arange(n) * b // n
        s = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        s = s.masked_fill(chunk[:, None] != chunk[None, :], float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_chunks_as_many_as_the_batch_in_an_unpacked_layout_are_refused():
    with pytest.raises(AttnScopeError, match="not supported yet"):
        check(_BatchManyChunks, kind="multihead")


class _OneSequenceAtATime(torch.nn.Module):
    """picoGPT's layer over a batch: each sequence alone (``x.unbind(0)``), its fused
    projection split into per-head lists, attention head by head, ``hstack``, the output
    projection; the same weights applied once per sequence. ``slip``: a softmax over the
    queries in every head."""

    def __init__(self, slip=False, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.slip, self.h = slip, heads
        self.w_attn = torch.nn.Parameter(torch.randn(d, 3 * d) * 0.2)
        self.b_attn = torch.nn.Parameter(torch.randn(3 * d) * 0.05)
        self.w_proj = torch.nn.Parameter(torch.randn(d, d) * 0.2)

    def _one(self, x):
        n = x.shape[0]
        parts = [p.chunk(self.h, -1) for p in (x @ self.w_attn + self.b_attn).chunk(3, -1)]
        mask = (1 - torch.ones(n, n).tril()) * -1e10
        heads = []
        for q, k, v in zip(*parts, strict=True):
            s = q @ k.T / math.sqrt(q.shape[-1]) + mask
            heads.append(s.softmax(0 if self.slip else -1) @ v)
        return torch.hstack(heads) @ self.w_proj

    def forward(self, x):
        return torch.stack([self._one(seq) for seq in x.unbind(0)])


@pytest.mark.parametrize("slip,want", [(False, ("ok",)), (True, ("weights", "softmax_wrong_dim"))])
def test_one_weight_applied_to_each_sequence_in_turn_is_one_projection(slip, want):
    """The batch's sequences are not heads: 4 heads, read from one sequence's operands (the
    layer had been read as 8 heads, and judged queries/other)."""
    report = check(lambda: _OneSequenceAtATime(slip), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.structure["heads"] == 4
