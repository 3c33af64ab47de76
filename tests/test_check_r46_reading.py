"""Readings added after rounds r45-r53: a cross layer whose wrapper hands it the second
sequence sequence-first; QK norms over the whole projection taken after an interleaved
rotation written with a quarter-turn swap; local windows one key short on one side or of
three keys; a softmax never divided, a softmin, a softmax twice, the weights times the
keys, a band handed to SDPA as floats; batches packed into one sequence (causal within
each, or mixing them); rotary tables indexed by the head; keys cut to part of the
sequence; cross blocks with a feed-forward inside, rotary on one side of them, or a second
input never read; the Set Transformer's heads; keys written one slot off into a cache."""

import math

import pytest
import torch
from conftest import outcome
from torch import nn
from torch.nn import functional as F

from attnscope import AttnScopeError, check


def _interleaved_rotation(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(tokens, batch, heads, dim)`` turned by adjacent pairs, the swap written as
    ``stack((-x2, x1))`` (a quarter turn of every pair) and the tables repeated per pair."""
    n, d = x.shape[0], x.shape[-1]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv).repeat_interleave(2, -1)
    cos, sin = (f(ang)[:, None, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
    swapped = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + swapped * sin


def _half_tables(rows: int, hd: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate_half``'s cos and sin ``(rows, hd)`` for rows 0..rows-1 (base 1e4), built in
    float64 and cast."""
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.cat([torch.outer(torch.arange(rows, dtype=torch.float64), inv)] * 2, -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate_half(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin


class _SeqFirst(nn.Module):
    """Attention laid out sequence first ``(tokens, batch, width)``, as Megatron-style code
    runs: 4 query heads over 2 key/value heads of 8, LayerNorms over the whole query and
    key projections (the keys' as wide as the key/value heads); ``context``: keys and values
    from a second sequence (no rotation), else an interleaved rotation, the norms taken
    ``after`` it where asked (the mistake ``qk_norm_misplaced``)."""

    def __init__(self, cross=False, after=False, d=32, heads=4, kv=2):
        super().__init__()
        self.cross, self.after, self.h, self.kv, self.hd = cross, after, heads, kv, d // heads
        self.to_q = nn.Linear(d, d, bias=False)
        self.to_k = nn.Linear(d, kv * self.hd, bias=False)
        self.to_v = nn.Linear(d, kv * self.hd, bias=False)
        self.norm_q, self.norm_k = nn.LayerNorm(d), nn.LayerNorm(kv * self.hd)
        self.to_out = nn.Linear(d, d)

    def forward(self, h, ctx=None):
        src = h if ctx is None else ctx
        q, k, v = self.to_q(h), self.to_k(src), self.to_v(src)
        if not self.after:
            q, k = self.norm_q(q), self.norm_k(k)
        q = q.unflatten(-1, (self.h, self.hd))
        k, v = (t.unflatten(-1, (self.kv, self.hd)) for t in (k, v))
        if not self.cross:
            q, k = _interleaved_rotation(q), _interleaved_rotation(k)
        if self.after:
            q = self.norm_q(q.flatten(-2)).unflatten(-1, (self.h, self.hd))
            k = self.norm_k(k.flatten(-2)).unflatten(-1, (self.kv, self.hd))
        rep = self.h // self.kv
        k, v = (t.unsqueeze(3).repeat(1, 1, 1, rep, 1).flatten(2, 3) for t in (k, v))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.permute(2, 0, 1, 3).flatten(2))


class _SeqFirstModel(nn.Module):
    """A wrapper that turns its inputs sequence first, and the second sequence through a
    projection of its own, before the layer (MAGI-1's caption branch)."""

    def __init__(self, cross=False, after=False, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(d, d)
        self.ctx_proj = nn.Sequential(nn.Linear(d, d), nn.SiLU())
        self.attn = _SeqFirst(cross, after, d)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)

    def forward(self, x, caption=None):
        h = self.embed(x).transpose(0, 1)
        ctx = None if caption is None else self.ctx_proj(caption).transpose(0, 1)
        return self.attn(h, ctx).transpose(0, 1)


def test_a_cross_layer_handed_its_second_sequence_sequence_first_is_read():
    """The keys' input is the wrapper's projected caption, held ``(tokens, batch, width)``:
    read as the layer holds it, the full-width norms on the queries and the (narrower)
    grouped keys are found (it had been refused as a norm it could not read)."""
    report = check(lambda: _SeqFirstModel(cross=True).eval(), kind="cross")
    assert report.ok, report.to_text(color=False)
    s = report.structure
    assert (s["cross"], s["qk_norm"], s["heads"], s["kv_heads"]) == (True, "full", 4, 2)


@pytest.mark.parametrize(
    ("after", "want"), [(False, ("ok",)), (True, ("normed_queries", "qk_norm_misplaced"))]
)
def test_full_width_norms_after_an_interleaved_rotation_are_misplaced(after, want):
    """The quarter-turn swap on the way (``stack((-x2, x1))``) turns every token alike: it
    is a step of the rotation, not the rotation the norms come after."""
    report = check(lambda: _SeqFirstModel(after=after).eval(), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if not after:
        assert report.structure["rope"]["pairing"] == "interleaved"
        assert report.structure["qk_norm"] == "full"


class _Local(nn.Module):
    """A bidirectional local window declared as ``sliding_window_size = half`` keys on
    either side, built ``tril(half) & triu(-half)``; ``edge``: the lower edge's diagonal
    ``-half + 1`` (one key short behind) or the upper's ``half - 1`` (one short ahead)."""

    def __init__(self, half=3, edge=None, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.sliding_window_size, self.edge, self.h = half, edge, heads
        self.Wqkv, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.Wqkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        w = self.sliding_window_size
        upper = w - 1 if self.edge == "upper" else w
        lower = -w + 1 if self.edge == "lower" else -w
        band = torch.ones(n, n, dtype=torch.bool).tril(upper).triu(lower)
        s = s.masked_fill(~band, torch.finfo(s.dtype).min)
        return self.out_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("edge", "want"),
    [
        (None, ("ok",)),
        ("lower", ("masked_scores", "window_size")),
        ("upper", ("masked_scores", "window_size")),
    ],
)
def test_a_local_window_one_key_short_on_one_side_is_a_window_size(edge, want):
    report = check(lambda: _Local(edge=edge).eval(), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if edge is None:
        assert report.structure["window"] == 7
    else:
        assert "ahead where 3 on either side are declared" in report.first_failure.message


def test_a_local_window_of_three_keys_is_read_as_one():
    """The query and one key on either side (half-width 1): read as the band it is, not as
    a causal window of two with its diagonal off."""
    report = check(lambda: _Local(half=1).eval(), kind="multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["window"] == 3


class _Eager(nn.Module):
    """Bidirectional attention written out: 4 heads of 8, per-head RMSNorms on queries and
    keys; ``slip``: ``"no_sum"`` (a stable softmax's exp, never divided by the row sum),
    ``"keys"`` (the weights times the normed keys, the value projection computed and
    dropped), or a local window of ``band`` keys either side handed to SDPA as floats
    (``"float_band"``: 1 where seen, 0 where hidden, added, not hidden)."""

    def __init__(self, slip=None, band=None, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.slip, self.h = slip, heads
        if band is not None:
            self.sliding_window_size = band
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.qn, self.kn = nn.RMSNorm(d // heads), nn.RMSNorm(d // heads)
        with torch.no_grad():
            self.qn.weight.uniform_(0.5, 1.5)
            self.kn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.h, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        q, k = self.qn(q), self.kn(k)
        if hasattr(self, "sliding_window_size"):
            w = self.sliding_window_size
            band = torch.ones(n, n, dtype=torch.bool).tril(w).triu(-w)
            mask = band.to(q.dtype) if self.slip == "float_band" else band
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.slip == "no_sum":
            # the batch packed into one sequence, kept apart by a block-diagonal mask (a
            # varlen kernel's eager stand-in): the weights are never seen in the reference's
            # layout, so only a mutation that makes them names the mistake
            q, k, v = (t.transpose(0, 1).reshape(1, self.h, b * n, -1) for t in (q, k, v))
            seq = torch.arange(b * n) // n
            s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
            s = s.masked_fill(seq[:, None] != seq[None, :], torch.finfo(s.dtype).min)
            out = (torch.exp(s - s.amax(-1, keepdim=True)) @ v).reshape(self.h, b, n, -1)
            out = out.transpose(0, 1)
        else:
            s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
            out = s.softmax(-1) @ (k if self.slip == "keys" else v)
        return self.o(out.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("slip", "band", "want"),
    [
        (None, None, ("ok",)),
        ("no_sum", None, ("weights", "not_softmax")),
        ("keys", None, ("context", "context_wrong_product")),
        (None, 2, ("ok",)),
        ("float_band", 2, ("masked_scores", "mask_fill_value")),
    ],
)
def test_weights_context_and_fills_written_out_are_named(slip, band, want):
    """A stable softmax that never divides (on a packed batch); the weights times the keys
    the scores took (the value projection's product going nowhere counts as never read, so
    the binding keeps it for the values); a boolean band cast to floats and added."""
    report = check(lambda: _Eager(slip, band).eval(), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if slip == "keys":
        assert "weights @ keys" in report.first_failure.message


class _Packed(nn.Module):
    """The batch packed into one sequence of ``batch * tokens`` (a varlen kernel's eager or
    SDPA stand-in), kept apart by a mask of sequence ids: ``arange // tokens`` (right) or,
    with ``modulo``, ``arange % batch`` (queries then see keys of other sequences);
    ``halved``: the scores also halved (a second slip no single mistake explains)."""

    def __init__(self, modulo=False, sdpa=False, halved=False, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.modulo, self.sdpa, self.halved, self.h = modulo, sdpa, halved, heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(1, b * n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        ids = torch.arange(b * n)
        seq = ids % b if self.modulo else ids // n
        keep = seq[:, None] == seq[None, :]
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h) * (0.5 if self.halved else 1)
            s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
            out = s.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("sdpa", [False, True])
@pytest.mark.parametrize(("modulo", "want"), [(False, ("ok",)), (True, ("scores", "batch_mixing"))])
def test_a_packed_batch_whose_mask_lets_sequences_see_each_other_is_batch_mixing(
    modulo, want, sdpa
):
    report = check(lambda: _Packed(modulo, sdpa).eval(), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if modulo:
        assert "packed into one sequence" in report.first_failure.message


def test_a_packed_leak_no_single_mistake_explains_is_refused_not_judged():
    with pytest.raises(AttnScopeError, match="keys of other sequences packed beside"):
        check(lambda: _Packed(modulo=True, halved=True).eval(), kind="multihead")


class _HeadIndexed(nn.Module):
    """Llama-style attention, ``rotate_half`` rotary on 4 heads of 8; ``by_head``: the
    tables built for ``arange(heads)`` and unsqueezed on the token axis, so every token of
    head h is turned by h's angles (tables indexed along the head axis)."""

    def __init__(self, by_head=False, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.by_head, self.h, self.hd = by_head, heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.h, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        cos, sin = _half_tables(self.h if self.by_head else n, self.hd, x.dtype)
        cos, sin = (t[:, None] if self.by_head else t for t in (cos, sin))
        q, k = _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("by_head", "want"), [(False, ("ok",)), (True, ("rotated_queries", "rope_positions"))]
)
def test_rotary_tables_indexed_by_the_head_are_wrong_positions(by_head, want):
    """Read as a rotation whose rows are the heads (it had been refused as rotary it could
    not read), the frequencies from it, and the slip named."""
    report = check(lambda: _HeadIndexed(by_head).eval(), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.structure["rope"] == {"pairing": "half", "fraction": 1.0, "base": 10000.0}
    if by_head:
        assert "head's number" in report.first_failure.message


class _PackedCausal(nn.Module):
    """A decoder's batch packed into one stream for SDPA, a block-diagonal causal mask of
    sequence ids keeping each sequence causal and apart (a varlen kernel's stand-in);
    ``train_items``: the keys and values cut to the first ``(n + 1) // 2`` tokens instead,
    every query attending to them alone (TabPFN's training items; no mask)."""

    def __init__(self, train_items=False, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.train_items, self.h = train_items, heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        if self.train_items:
            q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
            cut = (n + 1) // 2
            out = F.scaled_dot_product_attention(q, k[..., :cut, :], v[..., :cut, :])
            return self.o(out.transpose(1, 2).reshape(b, n, d))
        q, k, v = self.qkv(x).reshape(1, b * n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        seq, tok = torch.arange(b * n) // n, torch.arange(b * n) % n
        keep = (seq[:, None] == seq[None, :]) & (tok[None, :] <= tok[:, None])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o(out.transpose(1, 2).reshape(b, n, d))


def test_a_packed_batch_causal_within_each_sequence_is_causal_not_chunked():
    """Chunks of the probe's length along all the batch's tokens are its sequences (it had
    been refused as chunked attention)."""
    report = check(lambda: _PackedCausal().eval(), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["causal"] is True


def test_keys_cut_to_part_of_the_sequence_are_refused_not_judged():
    with pytest.raises(AttnScopeError, match="keys and values for 4 of the sequence's 7"):
        check(lambda: _PackedCausal(train_items=True).eval(), kind="multihead")


class _UnreadContext(nn.Module):
    """A cross layer whose keys and values are projected from the first input, the second
    (``context``) never read: its width cannot show, the key weights take the first's (a
    first parameter of another width, a gate's, is what a width search tries first)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.h = heads
        self.gate = nn.Parameter(torch.zeros(5))  # registered first; unused here
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x, context):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.h, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.h, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, n, d))


def test_a_cross_layer_that_never_reads_its_context_is_probed_at_the_inputs_width():
    report = check(lambda: _UnreadContext().eval(), kind="cross")
    assert outcome(report) == ("keys", "wrong_source"), report.to_text(color=False)


class _CrossBlock(nn.Module):
    """LightGlue's cross block: queries from the first set, keys and values from the second
    (a fused ``to_kv``), the message joined to the input and through an FFN inside the
    block's own forward; ``rotate_queries``: the queries alone turned by their positions
    (Surya's cross layer over image features)."""

    def __init__(self, rotate_queries=False, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.rotate_queries = heads, rotate_queries
        self.to_q, self.to_kv, self.to_out = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x0, x1):
        q = self.to_q(x0).unflatten(-1, (self.h, -1)).transpose(1, 2)
        k, v = (t.unflatten(-1, (self.h, -1)).transpose(1, 2) for t in self.to_kv(x1).chunk(2, -1))
        if self.rotate_queries:
            q = _interleaved_rotation(q.transpose(1, 2).transpose(0, 1)).transpose(0, 1)
            q = q.transpose(1, 2)
        w = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        ctx = torch.einsum("bhij,bhjd->bhid", w.softmax(-1), v)
        m = self.to_out(ctx.transpose(1, 2).flatten(2))
        return x0 + self.ffn(torch.cat([x0, m], -1))


class _CrossModel(nn.Module):
    def __init__(self, rotate_queries=False, d=32):
        super().__init__()
        self.cross = _CrossBlock(rotate_queries, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, a, b):
        return self.norm(self.cross(a, b))


def test_a_cross_block_with_a_feed_forward_inside_is_checked_at_its_attention():
    """The block's exit is found on a run that records its second sequence too (without it
    no attention was found there, and the block's output was held to the attention's)."""
    report = check(lambda: _CrossModel().eval(), kind="cross")
    assert report.ok, report.to_text(color=False)


def test_rotary_on_the_queries_alone_of_a_cross_layer_is_refused():
    with pytest.raises(AttnScopeError, match="on the queries only of a cross-attention layer"):
        check(lambda: _CrossModel(rotate_queries=True).eval(), kind="cross")


class _SetAttention(nn.Module):
    """The Set Transformer's multi-head block: heads cut by ``split(dim_split, 2)`` and
    joined on the batch axis head-major; ``slip``: ``"reshape"`` (cut by ``reshape(B * H,
    -1, dim_split)`` instead, merged back head-major all the same), ``"residual"`` (the
    original's ``O = Q_ + A V_``, the projected queries added inside), ``"softmin"``,
    ``"twice"`` (a softmax of the softmax)."""

    def __init__(self, slip=None, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.slip, self.h = slip, heads
        self.fc_q, self.fc_k, self.fc_v, self.fc_o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        q, k, v = self.fc_q(x), self.fc_k(x), self.fc_v(x)
        ds, b = q.shape[-1] // self.h, q.shape[0]
        if self.slip == "reshape":
            q_, k_, v_ = (t.reshape(b * self.h, -1, ds) for t in (q, k, v))
        else:
            q_, k_, v_ = (torch.cat(t.split(ds, 2), 0) for t in (q, k, v))
        s = q_.bmm(k_.transpose(1, 2)) / math.sqrt(ds)
        if self.slip == "softmin":
            a = F.softmin(s, 2)
        elif self.slip == "twice":
            a = torch.softmax(s, 2).softmax(2)
        else:
            a = torch.softmax(s, 2)
        o = a.bmm(v_) + (q_ if self.slip == "residual" else 0)
        return self.fc_o(torch.cat(o.split(b, 0), 2))


@pytest.mark.parametrize(
    ("slip", "want"),
    [
        (None, ("ok",)),
        ("reshape", ("queries", "heads_split")),
        ("softmin", ("weights", "not_softmax")),
        ("twice", ("weights", "not_softmax")),
    ],
)
def test_set_transformer_slips_are_named(slip, want):
    report = check(lambda: _SetAttention(slip).eval(), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)


def test_the_projected_queries_added_to_the_context_are_refused():
    with pytest.raises(AttnScopeError, match="projected queries added to the context"):
        check(lambda: _SetAttention("residual").eval(), kind="multihead")


class _WindowSoftmin(nn.Module):
    """A causal window of 3 keys as an additive mask of the dtype's minimum, the weights by
    ``F.softmin``: wherever every row hides some key, a fill of +inf (the minus sign
    dropped) gives the same output; the masked scores the layer made say the mask is right."""

    sliding_window = 3

    def __init__(self, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.h = heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = (j <= i) & (j > i - self.sliding_window)
        mask = torch.zeros(n, n).masked_fill(~seen, torch.finfo(torch.float32).min).to(x.dtype)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h) + mask
        return self.o((F.softmin(s, -1) @ v).transpose(1, 2).reshape(b, n, d))


def test_a_softmin_behind_a_mask_seen_right_is_the_weights_not_the_fill():
    report = check(lambda: _WindowSoftmin().eval(), kind="causal-multihead")
    assert outcome(report) == ("weights", "not_softmax"), report.to_text(color=False)


class _RotatedCache(nn.Module):
    """A causal layer with ``rotate_half`` rotary whose keys and values go through a static
    cache of the sequence's length; ``slip``: ``"slot"`` (the keys written at
    ``input_pos - 1``, a 1-based position used as a slot, the values in place), ``"ring"``
    (at ``(input_pos + 1) % n``), ``"reshape"`` (the keys ``reshape``d to ``(..., D, T)``
    where a transpose was meant)."""

    def __init__(self, slip=None, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.slip, self.h, self.hd = slip, heads, d // heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        cos, sin = _half_tables(n, self.hd, x.dtype)
        q, k = _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
        pos = torch.arange(n)
        k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
        slots = {"slot": pos - 1, "ring": (pos + 1) % n}.get(self.slip, pos)
        k_cache[:, :, slots] = k
        v_cache[:, :, pos] = v
        if self.slip == "reshape":
            kt = k_cache.reshape(b, self.h, self.hd, n)
        else:
            kt = k_cache.transpose(-1, -2)
        s = q @ kt / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v_cache).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("slip", "want"),
    [
        (None, ("ok",)),
        ("slot", ("scores", "wrong_key_index")),
        ("ring", ("scores", "wrong_key_index")),
        ("reshape", ("scores", "not_dot_product")),
    ],
)
def test_rotated_keys_written_one_slot_off_or_reshaped_are_read_and_named(slip, want):
    """The keys' rotation is read on the cache's slots rolled back, or on the scrambled view
    read back by the same reshape (both had been refused as rotary it could not read)."""
    report = check(lambda: _RotatedCache(slip).eval(), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.structure["rope"]["pairing"] == "half"
