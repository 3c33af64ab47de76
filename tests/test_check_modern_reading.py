"""Modern attention read from what the computation does, in styles that hide it: a norm
applied after the rotation, rotation tables whose rows follow the batch, attention written
inline in a block. Small synthetic layers, each with its correct twin: the mechanism that
names the mistake must leave correct code alone."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check


def _tables(n: int, d: int, base: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class _NormedRotary(nn.Module):
    """(B, T, H, D) heads, a per-head LayerNorm with a (H, D) gain and shift, rotary;
    ``norm_first`` says which comes first (the norm first is the design)."""

    def __init__(self, norm_first: bool, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd, self.norm_first = heads, d // heads, norm_first
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)
        g = torch.Generator().manual_seed(3)
        self.q_gain = nn.Parameter(0.5 + torch.rand(heads, self.hd, generator=g))
        self.q_shift = nn.Parameter(torch.randn(heads, self.hd, generator=g) * 0.1)
        self.k_gain = nn.Parameter(0.5 + torch.rand(heads, self.hd, generator=g))
        self.k_shift = nn.Parameter(torch.randn(heads, self.hd, generator=g) * 0.1)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.h, self.hd)
        k = self.k_proj(x).view(b, n, self.h, self.hd)
        v = self.v_proj(x).view(b, n, self.h, self.hd).transpose(1, 2)
        cos, sin = _tables(n, self.hd)
        cos, sin = cos[:, None], sin[:, None]

        def norm(t, gain, shift):
            return F.layer_norm(t, (self.hd,), eps=1e-5) * gain + shift

        def rot(t):
            return t * cos + _rotate_half(t) * sin

        if self.norm_first:
            q, k = rot(norm(q, self.q_gain, self.q_shift)), rot(norm(k, self.k_gain, self.k_shift))
        else:
            q, k = norm(rot(q), self.q_gain, self.q_shift), norm(rot(k), self.k_gain, self.k_shift)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = s.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("norm_first", [True, False])
def test_a_layernorm_after_the_rotation_is_read_as_misplaced(norm_first):
    """A LayerNorm subtracts a mean, which does not commute with the rotation: read from
    the rotated tensor the computation made on the way, then normed."""
    report = check(lambda: _NormedRotary(norm_first))
    want = ("ok",) if norm_first else ("normed_queries", "qk_norm_misplaced")
    assert outcome(report) == want, report.to_text(color=False)
    if norm_first:
        assert report.structure["qk_norm"] == "per-head"
        assert report.structure["rope"]["pairing"] == "half"


class _SequenceFirstTables(nn.Module):
    """Rotation tables picked with ``x.size(0)`` rows: the position axis of sequence-first
    code; on batch-first tensors (``rows_by_batch``) that is the batch."""

    def __init__(self, rows_by_batch: bool, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd, self.by_batch = heads, d // heads, rows_by_batch
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        cos, sin = _tables(64, self.hd)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x):  # (B, T, d)
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).unbind(2)
        if self.by_batch:
            rows = q.size(0)  # was the sequence length in a (T, B, H, D) layout
            cos, sin = self.cos[:rows, None, None], self.sin[:rows, None, None]
        else:
            cos, sin = self.cos[:n, None], self.sin[:n, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("rows_by_batch", [False, True])
def test_rotation_tables_indexed_by_the_batch_are_wrong_positions(rows_by_batch):
    report = check(lambda: _SequenceFirstTables(rows_by_batch))
    want = ("rotated_queries", "rope_positions") if rows_by_batch else ("ok",)
    assert outcome(report) == want, report.to_text(color=False)
    if rows_by_batch:
        assert "batch index" in report.first_failure.message
    else:
        assert report.structure["rope"]["base"] == 10000.0


class _InlineBlock(nn.Module):
    """A pre-norm block that computes its attention in a method of its own (no attention
    submodule), then adds the residual and runs an MLP: the attention's output is what its
    output projection makes."""

    def __init__(self, norm_queries: bool = True, d: int = 32, heads: int = 4, kv: int = 2):
        super().__init__()
        self.h, self.kv, self.hd, self.norm_queries = heads, kv, d // heads, norm_queries
        self.dims = (d, kv * self.hd, kv * self.hd)
        self.ln = nn.LayerNorm(d)
        self.att_proj = nn.Linear(d, sum(self.dims), bias=False)
        self.q_norm = nn.LayerNorm(d, bias=False)
        self.k_norm = nn.LayerNorm(kv * self.hd, bias=False)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)
        self.att_out = nn.Linear(d, d, bias=False)
        self.ff_norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def attention(self, q, k, v):
        b, n, c = q.shape
        if self.norm_queries:
            q = self.q_norm(q)
        k = self.k_norm(k)
        q = q.view(b, n, self.h, self.hd).transpose(1, 2)
        k = k.view(b, n, self.kv, self.hd).transpose(1, 2)
        v = v.view(b, n, self.kv, self.hd).transpose(1, 2)
        cos, sin = _tables(n, self.hd)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.att_out(out.transpose(1, 2).reshape(b, n, c))

    def forward(self, x):
        q, k, v = self.att_proj(self.ln(x)).split(self.dims, dim=-1)
        x = x + self.attention(q, k, v)
        return x + self.ff(self.ff_norm(x))


@pytest.mark.parametrize("norm_queries", [True, False])
def test_attention_inline_in_a_block_is_judged_at_its_output_projection(norm_queries):
    report = check(lambda: _InlineBlock(norm_queries), kind="causal-multihead")
    want = ("ok",) if norm_queries else ("normed_queries", "qk_norm_missing")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.layer is None
    assert any("computed in its own forward" in n for n in report.notes)
    if norm_queries:
        s = report.structure
        assert (s["heads"], s["kv_heads"], s["qk_norm"]) == (4, 2, "full")


def test_inline_attention_inferred_kind_and_a_plain_block():
    """Without a QK norm or rotation, kind inferred: the block's residual and MLP are not
    held against the attention."""

    class Block(nn.Module):
        def __init__(self, d=24, heads=3):
            super().__init__()
            self.h = heads
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, d), nn.Tanh())

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            s = q @ k.transpose(-2, -1) / math.sqrt(d // self.h)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            a = self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))
            x = x + a
            return x + self.mlp(x)

    report = check(Block)
    assert report.ok, report.to_text(color=False)
    assert report.kind == "causal-multihead"


class _QFormerLike(nn.Module):
    """A cross-attention layer (it says so) inside a wrapper whose second input is optional;
    ``reads_context`` False: keys and values from the queries' own input."""

    def __init__(self, cross: bool, reads_context: bool, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.is_cross_attention = cross
        self.reads_context = reads_context
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def split(self, t):
        return t.view(*t.shape[:-1], self.h, self.hd).transpose(1, 2)

    def forward(self, hidden_states, encoder_hidden_states=None):
        use = encoder_hidden_states is not None and self.reads_context
        kv = encoder_hidden_states if use else hidden_states
        q, k = self.split(self.query(hidden_states)), self.split(self.key(kv))
        v = self.split(self.value(kv))
        w = (q @ k.transpose(-1, -2) / math.sqrt(self.hd)).softmax(-1)
        out = (w @ v).transpose(1, 2)
        return out.reshape(*out.shape[:-2], -1)


class _Wrapper(nn.Module):
    def __init__(self, cross: bool, reads_context: bool):
        super().__init__()
        self.attention = _QFormerLike(cross, reads_context)
        self.dense = nn.Linear(32, 32)

    def forward(self, hidden_states, encoder_hidden_states=None):
        return self.dense(self.attention(hidden_states, encoder_hidden_states))


@pytest.mark.parametrize(
    "cross,reads,want,kind",
    [
        (True, True, ("ok",), "cross"),
        (True, False, ("keys", "wrong_source"), "cross"),
        (False, True, ("ok",), "multihead"),  # says self-attention: judged as such
    ],
)
def test_a_layer_that_declares_cross_attention_gets_its_second_sequence(cross, reads, want, kind):
    report = check(lambda: _Wrapper(cross, reads))
    assert outcome(report) == want, report.to_text(color=False)
    assert report.kind == kind, report.kind_reason


class _PackedAttention(nn.Module):
    """Attention on a flattened batch ``(tokens, d)``: per-token positions, one causal
    SDPA call per sequence (vLLM-style backends, packed sequences)."""

    def __init__(self, scale: float | None = None, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd, self.scale = heads, d // heads, scale
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        inv = 1.0 / 10_000 ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        self.register_buffer("inv", inv.float())

    def forward(self, positions, x, lens):
        t = x.shape[0]
        q, k, v = (a.view(t, self.h, self.hd) for a in self.qkv(x).chunk(3, -1))
        ang = positions[:, None].float() * self.inv  # (tokens, hd/2), interleaved pairs
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]

        def rot(a):
            even, odd = a[..., ::2], a[..., 1::2]
            return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)

        q, k = rot(q), rot(k)
        out = torch.empty_like(q)
        start = 0
        for n in lens:
            sl = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1),
                k[sl].transpose(0, 1),
                v[sl].transpose(0, 1),
                is_causal=True,
                scale=self.scale,
            )
            out[sl] = o.transpose(0, 1)
            start += n
        return self.out(out.reshape(t, -1))


class _Runner(nn.Module):
    """Takes ``(batch, tokens, d)``, flattens it and passes per-token positions."""

    def __init__(self, scale=None, restart: bool = True, tokens_first: bool = False):
        super().__init__()
        self.attn = _PackedAttention(scale)
        self.restart, self.tokens_first = restart, tokens_first

    def forward(self, x):
        b, n, d = x.shape
        lens = [n] * b
        if self.restart:
            positions = torch.cat([torch.arange(n) for _ in lens])
        else:  # counted on across the packed sequences: a uniform shift per sequence
            positions = torch.arange(b * n)
        if self.tokens_first:
            return self.attn(positions, x.transpose(0, 1).reshape(b * n, d), lens)
        return self.attn(positions, x.reshape(b * n, d), lens).view(b, n, d)


@pytest.mark.parametrize(
    "kw,want",
    [
        (dict(), ("ok",)),
        (dict(restart=False), ("ok",)),  # positions shifted alike within each sequence
        (dict(scale=1.0), ("scaled_scores", "missing_scale")),
    ],
)
def test_a_flattened_token_batch_inside_a_runner(kw, want):
    report = check(lambda: _Runner(**kw))
    assert outcome(report) == want, report.to_text(color=False)
    assert report.layer == "attn"
    if want == ("ok",):
        s = report.structure
        assert (s["heads"], s["head_dim"], s["rope"]["pairing"]) == (4, 8, "interleaved")


def test_a_batch_flattened_tokens_first_is_not_entered_as_sequences():
    """``(T, B, d)`` flattened: rows are not sequence after sequence; no verdict on it."""
    with pytest.raises(AttnScopeError):
        check(lambda: _Runner(tokens_first=True))


class _PreAttnScalar(nn.Module):
    """Gemma-style: the configuration declares ``query_pre_attn_scalar`` and the queries are
    scaled by its 1/sqrt; ``uses`` is what the code actually divides by."""

    def __init__(self, declared: int, uses: int, d: int = 32, heads: int = 4):
        super().__init__()
        self.config = SimpleNamespace(query_pre_attn_scalar=declared)
        self.h, self.hd, self.uses = heads, d // heads, uses
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (
            f(x).view(b, n, self.h, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        s = (q * self.uses**-0.5) @ k.transpose(-2, -1)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize(
    "declared,uses,want",
    [
        (24, 24, ("ok",)),  # the declared scale, not 1/sqrt(head_dim): correct
        (8, 8, ("ok",)),  # declared as the head size
        (24, 8, ("scaled_scores", "wrong_scale")),  # the declaration ignored
    ],
)
def test_a_declared_query_pre_attn_scalar_is_the_scale(declared, uses, want):
    report = check(lambda: _PreAttnScalar(declared, uses))
    assert outcome(report) == want, report.to_text(color=False)
    if want != ("ok",):
        assert "query_pre_attn_scalar" in report.first_failure.message


def _slopes(h: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])


class _BiasTaker(nn.Module):
    """Takes an additive mask from its model; ``uses`` False: a fast path that calls SDPA
    with is_causal=True and leaves the mask (and whatever it carries) aside."""

    def __init__(self, uses: bool, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd, self.uses = heads, d // heads, uses
        self.W_pack, self.o_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        b, n, d = hidden_states.shape
        q, k, v = self.W_pack(hidden_states).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        if self.uses:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))


class _BiasModel(nn.Module):
    """Builds triu(-inf) plus, with ``alibi``, ``slope_h * j`` (Baichuan's key-position
    form), and hands it to its layer as the mask."""

    def __init__(self, uses: bool, alibi: bool, heads: int = 4):
        super().__init__()
        self.layer, self.alibi, self.h = _BiasTaker(uses, heads=heads), alibi, heads

    def forward(self, x):
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None].repeat(self.h, 1, 1)
        if self.alibi:
            mask = mask + _slopes(self.h)[:, None, None] * torch.arange(n)[None, None, :]
        return x + self.layer(x, attention_mask=mask[None])


@pytest.mark.parametrize(
    "uses,alibi,want",
    [
        (True, True, ("ok",)),
        (False, True, ("biased_scores", "bias_missing")),  # handed ALiBi, never read
        (False, False, ("ok",)),  # a plain causal mask left aside for is_causal: correct
    ],
)
def test_a_position_bias_handed_to_the_layer_and_never_read(uses, alibi, want):
    report = check(lambda: _BiasModel(uses, alibi), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.layer == "layer"
    if want == ("ok",):
        assert report.structure["bias"] == ("alibi" if alibi else None)


class _Local(nn.Module):
    """ModernBERT/Longformer-style local attention: each query sees the keys within
    ``half`` positions on either side; ``declared`` is its layer's ``local_attention``
    ``(left, right)`` pair (ModernBERT), when it has one."""

    def __init__(self, fused=False, half=2, declared=None, d=32, heads=4):
        super().__init__()
        self.h, self.hd, self.half, self.fused = heads, d // heads, half, fused
        if declared is not None:
            self.local_attention = declared
        self.Wqkv, self.Wo = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.Wqkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        if self.half is None:
            out = s.softmax(-1) @ v
        else:
            i = torch.arange(n)
            far = (i[:, None] - i[None, :]).abs() > self.half
            if self.fused:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~far)
            else:
                out = s.masked_fill(far, float("-inf")).softmax(-1) @ v
        return self.Wo(out.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("fused", [False, True])
def test_a_bidirectional_local_window_is_read_from_its_mask(fused):
    """Keys within h positions on either side: an encoder's window of 2h + 1 keys (itself
    included), read from the mask, whether it is seen at the first probe or only on a
    longer call (a window wider than the probe)."""
    for half in (2, 12):
        report = check(lambda half=half: _Local(fused, half))
        assert report.ok, report.to_text(color=False)
        assert report.kind == "multihead"
        assert report.structure["window"] == 2 * half + 1


@pytest.mark.parametrize(
    "half,declared,want",
    [
        (2, (2, 2), ("ok",)),
        (3, (2, 2), ("masked_scores", "window_size")),  # a key too far on each side
        (4, (2, 2), ("masked_scores", "window_size")),  # twice as wide
        (None, (2, 2), ("masked_scores", "window_missing")),  # declared, never applied
        (None, (-1, -1), ("ok",)),  # ModernBERT's global layers: no window
    ],
)
def test_a_declared_local_window_is_held_to_its_declaration(half, declared, want):
    report = check(lambda: _Local(False, half, declared), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if want == ("ok",):
        assert report.structure["window"] == (None if half is None else 2 * half + 1)


def test_a_bidirectional_window_in_a_layer_checked_as_causal_shows_its_future():
    """A band on either side read in a causal layer is the causal window inside it (the
    query and the keys before it within the band: llm-foundry's band beside its causal
    mask); a layer with the band alone shows the keys after the query within it."""
    report = check(lambda: _Local(False, 2), kind="causal-multihead")
    assert outcome(report) == ("masked_scores", "mask_diagonal")
    assert "shows a future token" in report.first_failure.message


class _BareBlock(nn.Module):
    """A block whose attention and MLP read bare parameters (no submodules but a norm):
    the output projection applied as ``F.linear(ctx, w_o)`` or ``ctx @ w_o.T + b_o``."""

    def __init__(self, matmul: bool, scale: float | None = None, d: int = 24, heads: int = 3):
        super().__init__()
        self.h, self.matmul, self.scale = heads, matmul, scale
        g = torch.Generator().manual_seed(5)
        self.w_qkv = nn.Parameter(torch.randn(3 * d, d, generator=g) / d**0.5)
        self.w_o = nn.Parameter(torch.randn(d, d, generator=g) / d**0.5)
        self.b_o = nn.Parameter(torch.randn(d, generator=g) * 0.1)
        self.ln = nn.LayerNorm(d)
        self.w1 = nn.Parameter(torch.randn(2 * d, d, generator=g) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(d, 2 * d, generator=g) / d**0.5)

    def forward(self, x):
        b, n, d = x.shape
        qkv = F.linear(self.ln(x), self.w_qkv).view(b, n, 3, self.h, d // self.h)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        o = o.transpose(1, 2).reshape(b, n, d)
        a = o @ self.w_o.T + self.b_o if self.matmul else F.linear(o, self.w_o, self.b_o)
        x = x + a
        return x + F.linear(F.gelu(F.linear(x, self.w1)), self.w2)


@pytest.mark.parametrize(
    "matmul,scale,want",
    [
        (False, None, ("ok",)),
        (True, None, ("ok",)),
        (True, 1.0, ("scaled_scores", "missing_scale")),
    ],
)
def test_inline_attention_with_a_bare_parameter_output_projection(matmul, scale, want):
    report = check(lambda: _BareBlock(matmul, scale))
    assert outcome(report) == want, report.to_text(color=False)
    assert report.kind == "causal-multihead", report.kind_reason
    assert any("computed in its own forward" in n for n in report.notes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_module_in_another_float_type_is_checked_on_a_float32_copy(dtype):
    """Checkpoints load in bfloat16: such a layer is checked (not refused for its float32
    probes), its mistakes still named, and the module handed in is left as it was."""
    from attnscope import GroupedQueryAttention

    layer = GroupedQueryAttention(32, 32, 4, 2).to(dtype)
    report = check(layer)
    assert report.ok, report.to_text(color=False)
    assert any("checked in float32" in n for n in report.notes)
    assert next(layer.parameters()).dtype == dtype
    buggy = _PreAttnScalar(24, 8).to(dtype)  # the declared scale ignored
    assert outcome(check(buggy)) == ("scaled_scores", "wrong_scale")


class _TimeFirstAttention(nn.Module):
    """fairseq-style: takes ``(tokens, batch, d)`` and says so in its own code."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj, self.k_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(key), self.v_proj(value)
        q, k, v = (
            t.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
            for t in (q, k, v)
        )
        w = F.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
        out = torch.bmm(w, v).transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(out), w


class _TimeFirstLayer(nn.Module):
    def __init__(self, mha: nn.Module | None = None, d: int = 32):
        super().__init__()
        self.self_attn = mha or _TimeFirstAttention(d)
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        r = x
        x, _ = self.self_attn(x, x, x)
        x = self.ln(r + x)
        return x + self.fc(x)


def test_a_layer_that_says_it_takes_tokens_first_is_called_so():
    """Fed batch first it would attend across the batch (batch_mixing on correct code):
    its own code (``tgt_len, bsz, embed_dim = query.size()``) says it is tokens first, and
    a wrapper that hands it its own input is tokens first too."""
    for make, layer in ((_TimeFirstAttention, None), (_TimeFirstLayer, "self_attn")):
        report = check(make)
        assert report.ok, report.to_text(color=False)
        assert report.layer == layer


def test_a_batch_first_wrapper_around_torch_mha_without_batch_first_still_mixes():
    """nn.MultiheadAttention says nothing in its code: handed (batch, tokens, d) by a batch
    first wrapper, it attends across the batch, and that is named."""
    report = check(lambda: _TimeFirstLayer(nn.MultiheadAttention(32, 4)))
    assert outcome(report) == ("scores", "batch_mixing"), report.to_text(color=False)


@pytest.mark.parametrize("pattern", ["sink", "prefix", "documents"])
def test_a_mask_of_a_designed_pattern_not_modelled_is_refused(pattern):
    """Attention sinks (a window plus the first token), a prefix-LM mask, packed documents:
    correct by their own design and not textbook attention; exit 2 naming the mask, never
    not_dot_product or mask_diagonal on them."""

    class Masked(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.h, self.hd = heads, d // heads
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
            ones = torch.ones(n, n, dtype=torch.bool)
            hide = ones.triu(1)
            if pattern == "sink":
                hide = hide | ones.tril(-3)
                hide[:, 0] = False
            elif pattern == "prefix":
                hide = hide.clone()
                hide[:3, :3] = False
            else:
                doc = torch.arange(n) >= n // 2
                hide = hide | (doc[:, None] != doc[None, :])
            s = (q @ k.transpose(-2, -1) / math.sqrt(self.hd)).masked_fill(hide, float("-inf"))
            return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))

    with pytest.raises(AttnScopeError, match="not supported yet: a mask of another pattern"):
        check(Masked)


def test_a_tanh_on_the_scores_with_no_cap_declared_is_refused():
    class Capped(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.h, self.hd = heads, d // heads
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
            s = torch.tanh(q @ k.transpose(-2, -1) / math.sqrt(self.hd) / 2.0) * 2.0
            return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))

    with pytest.raises(AttnScopeError, match="not supported yet: logit soft-capping"):
        check(Capped)


def test_a_tanh_in_the_softmaxs_place_is_still_not_softmax():
    """Soft-capping is a tanh followed by a softmax; a tanh instead of it is a mistake."""

    class TanhWeights(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.h, self.hd = heads, d // heads
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
            w = torch.tanh(q @ k.transpose(-2, -1) / math.sqrt(self.hd))
            return self.o((w @ v).transpose(1, 2).reshape(b, n, d))

    assert outcome(check(TanhWeights)) == ("weights", "not_softmax")


@pytest.mark.parametrize(
    "name,other",
    [
        ("encoder_hidden_states", True),
        ("context", True),
        ("y", True),
        ("xa", True),
        ("image_embeds", True),
        ("rotary_pos_emb", False),  # Qwen's: a "y" inside a word names no sequence
        ("key_value_states_mask", False),
        ("history", False),
        ("attention_mask", False),
    ],
)
def test_a_second_input_is_another_sequence_by_its_name_not_a_letter_in_it(name, other):
    """The tie-break that names a second input another sequence (cross-attention) reads
    whole words for its short hints: Qwen 1's ``rotary_pos_emb`` was taken for ``y``."""
    from attnscope.checking.probe import _names_a_sequence

    assert _names_a_sequence(name) is other


@pytest.mark.parametrize("start", [0, 1, 7, 40])
def test_rotary_tables_read_where_their_positions_start_past_a_whole_turn(start):
    """A table read from its tail starts positions on: the fastest pair's angle alone is
    known only up to whole turns (7 reads as 0.72); a slow pair says how many."""
    from attnscope.checking.rotary import Tables, read_side

    rot, n = 16, 9
    inv = 10_000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv  # (T, rot/2)
    both = torch.cat([angles, angles], dim=-1)  # laid out for the halves pairing
    side, freqs = read_side(Tables("half", rot, both.cos(), both.sin(), 1.0), "half")
    assert side.offset == pytest.approx(start, abs=1e-3)
    torch.testing.assert_close(freqs, inv)
