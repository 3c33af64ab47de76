"""Round 10's styles read from what the computation does: a ``baddbmm`` over (batch * heads)
folds whose added term is made from the input's shape, a sigmoid in the softmax's place
with sigmoid attention's shift, ``nn.MultiheadAttention`` as cross-attention (``kdim``),
a context a wrapper projects and the layer never reads, heads cut wrong before a complex
rotation, and keys rotated from a table's tail. Small synthetic layers, each with its
correct twin where there is one: what names the mistake must leave correct code alone."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check

# ------------------------------------------------------------------ bmm over (b*h) folds


class _Bmm(nn.Module):
    """Heads folded into the batch, ``baddbmm(x.new_zeros(...), q, k^T, alpha=scale)``;
    ``bug`` swaps the product's operands, folds the keys (heads, batch), or turns the
    scores into weights with a sigmoid (``shifted``: sigmoid attention's ``- log n``)."""

    def __init__(self, bug: str | None = None, d: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(10)
        self.bug, self.h, self.hd = bug, heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def fold(self, t, heads_first=False):
        b, n, _ = t.shape
        t = t.view(b, n, self.h, self.hd)
        t = t.permute(2, 0, 1, 3) if heads_first else t.permute(0, 2, 1, 3)
        return t.reshape(b * self.h, n, self.hd)

    def forward(self, x):
        b, n, _ = x.shape
        zeros = x.new_zeros(b * self.h, n, n)
        q, v = self.fold(self.q(x)), self.fold(self.v(x))
        k = self.fold(self.k(x), heads_first=self.bug == "keys_head_major")
        a, c = (k, q) if self.bug == "swapped" else (q, k)
        s = torch.baddbmm(zeros, a, c.transpose(1, 2), beta=1.0, alpha=self.hd**-0.5)
        if self.bug == "sigmoid":
            w = torch.sigmoid(s)
        elif self.bug == "shifted_sigmoid":
            w = torch.sigmoid(s - math.log(n))
        else:
            w = torch.softmax(s, dim=-1)
        ctx = torch.bmm(w, v).view(b, self.h, n, self.hd).permute(0, 2, 1, 3)
        return self.o(ctx.reshape(b, n, -1))


@pytest.mark.parametrize(
    "bug,want",
    [
        (None, ("ok",)),
        ("swapped", ("scores", "scores_transposed")),
        ("keys_head_major", ("scores", "batch_mixing")),
        ("sigmoid", ("weights", "not_softmax")),
    ],
)
def test_a_baddbmm_whose_added_term_is_made_from_the_input_is_the_scores(bug, want):
    """The term ``baddbmm`` adds (zeros made with ``x.new_zeros``, so from the input) is
    no operand of its product: the scores are still ``q @ k^T``."""
    report = check(lambda: _Bmm(bug), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)


def test_a_sigmoid_of_shifted_scores_is_refused_as_sigmoid_attention():
    """A constant shift a softmax would ignore, then a sigmoid: sigmoid attention (a
    design the checker does not model), refused; a bare sigmoid stays not_softmax."""
    with pytest.raises(AttnScopeError, match="sigmoid attention"):
        check(lambda: _Bmm("shifted_sigmoid"), kind="multihead")


# ------------------------------------------------------------------ MHA as cross-attention


class _MhaCross(nn.Module):
    def __init__(self, kdim: int | None):
        super().__init__()
        torch.manual_seed(11)
        self.mha = nn.MultiheadAttention(32, 4, kdim=kdim, vdim=kdim, batch_first=True)
        with torch.no_grad():
            self.mha.in_proj_bias.uniform_(-0.1, 0.1)
        self.norm = nn.LayerNorm(32)

    def forward(self, x, memory):
        return self.norm(x + self.mha(query=x, key=memory, value=memory, need_weights=False)[0])


@pytest.mark.parametrize("kdim", [24, None])
def test_nn_multiheadattention_as_cross_attention_is_checked(kdim):
    report = check(lambda: _MhaCross(kdim).eval())
    assert outcome(report) == ("ok",), report.to_text(color=False)
    assert report.kind == "cross"
    assert report.structure["cross"] is True and report.structure["heads"] == 4


class _MhaWithPositions(nn.Module):
    """DETR's use: a position embedding added to the keys' input (and the queries') only."""

    def __init__(self, cross: bool):
        super().__init__()
        torch.manual_seed(14)
        self.cross = cross
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.pos = nn.Parameter(torch.randn(64, 32) * 0.5)

    def forward(self, x, memory=None):
        src = memory if self.cross else x
        keys = src + self.pos[: src.shape[1]]
        query = x if self.cross else keys
        return self.mha(query, keys, src, need_weights=False)[0]


@pytest.mark.parametrize("cross", [False, True])
def test_nn_multiheadattention_given_a_position_embedding_on_its_keys_only_is_refused(cross):
    """Keys and values given different tensors: not modelled, refused (never judged)."""
    with pytest.raises(AttnScopeError, match="different tensors"):
        check(lambda: _MhaWithPositions(cross).eval(), kind="cross" if cross else None)


# ------------------------------------------------------------------ a context never read


class _Swallowing(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, hidden_states, key_value_states=None, **kwargs):
        b, n, d = hidden_states.shape
        src = hidden_states if key_value_states is None else key_value_states

        def heads(t):
            return t.view(b, -1, self.h, self.hd).transpose(1, 2)

        q = heads(self.q_proj(hidden_states))
        k, v = heads(self.k_proj(src)), heads(self.v_proj(src))
        w = torch.softmax(q @ k.transpose(-2, -1) * self.hd**-0.5, dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, d))


class _ProjectedContext(nn.Module):
    """The wrapper projects its context (24 -> 32) and hands it to the layer under a name
    the layer does not take (``bug``) or the one it does."""

    def __init__(self, bug: bool):
        super().__init__()
        torch.manual_seed(12)
        self.bug = bug
        self.enc_proj = nn.Linear(24, 32)
        self.attn = _Swallowing()

    def forward(self, hidden_states, encoder_hidden_states):
        ctx = self.enc_proj(encoder_hidden_states)
        if self.bug:
            return hidden_states + self.attn(hidden_states, encoder_hidden_states=ctx)
        return hidden_states + self.attn(hidden_states, key_value_states=ctx)


@pytest.mark.parametrize("bug", [False, True])
def test_a_projected_context_the_layer_never_reads_is_keys_from_the_wrong_source(bug):
    """The context reaches the layer's call but not its output: a second sequence its keys
    and values do not read (the argument's name breaks the tie), probed as the wrapper
    makes it for the layer."""
    want = ("keys", "wrong_source") if bug else ("ok",)
    for kind in (None, "cross"):
        report = check(lambda: _ProjectedContext(bug).eval(), kind=kind)
        assert outcome(report) == want, report.to_text(color=False)
        assert report.kind == "cross"


# ------------------------------------------------------------------ complex rotation


def _freqs(hd: int, n: int, base: float = 10_000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, hd, 2).double() / hd)
    return torch.polar(torch.ones(n, hd // 2).double(), torch.outer(torch.arange(n).double(), inv))


class _Complex(nn.Module):
    """(B, T, H, D) heads rotated as complex numbers; ``bug``: the queries viewed heads
    first from the projection, or the keys' table rows taken from its tail."""

    def __init__(self, bug: str | None = None, d: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(13)
        self.bug, self.h, self.hd = bug, heads, d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.register_buffer("freqs", _freqs(self.hd, 64), persistent=False)

    def rotate(self, t, freqs):
        c = torch.view_as_complex(t.double().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(c * freqs[None, :, None]).flatten(3).type_as(t)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.bug == "query_heads_first":
            q = q.view(b, self.h, n, self.hd).transpose(1, 2)
        else:
            q = q.view(b, n, self.h, self.hd)
        k, v = k.view(b, n, self.h, self.hd), v.view(b, n, self.h, self.hd)
        q = self.rotate(q, self.freqs[:n])
        k = self.rotate(k, self.freqs[-n:] if self.bug == "key_tail" else self.freqs[:n])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize(
    "bug,want",
    [
        (None, ("ok",)),
        ("query_heads_first", ("queries", "heads_split")),
        ("key_tail", ("rotated_keys", "rope_positions")),
    ],
)
def test_a_complex_rotation_is_read_past_a_mistake_around_it(bug, want):
    """Heads cut from the wrong axis before the rotation: the rotation is read from the
    layer's own tensors (moved about, not computed on) and the split is judged. Keys
    rotated from the table's tail: their start is read past a turn of the fastest pair."""
    report = check(lambda: _Complex(bug), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    assert report.structure["rope"]["pairing"] == "interleaved"


class _HandWrittenWithPositions(nn.Module):
    """DETR's encoder self-attention and decoder cross-attention written by hand: a learned
    position embedding added to the queries' and keys' input, not the values'."""

    def __init__(self, cross: bool):
        super().__init__()
        torch.manual_seed(15)
        self.cross = cross
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.pos = nn.Parameter(torch.randn(64, 32) * 0.5)

    def forward(self, x, memory=None):
        b, n, _ = x.shape
        src = memory if self.cross else x
        with_pos = src + self.pos[: src.shape[1]]
        query = x if self.cross else with_pos

        def heads(t):
            return t.view(b, -1, 4, 8).transpose(1, 2)

        q, k, v = heads(self.q(query)), heads(self.k(with_pos)), heads(self.v(src))
        w = (q @ k.transpose(-1, -2) / 8**0.5).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, 32))


@pytest.mark.parametrize("cross", [False, True])
def test_a_position_embedding_on_some_projections_inputs_only_is_refused(cross):
    """The reference projects every role from one input: a tensor added to the input of
    the queries and keys only is not modelled (it was judged a mistake before)."""
    with pytest.raises(AttnScopeError, match="added to the input of some projections only"):
        check(lambda: _HandWrittenWithPositions(cross).eval(), kind="cross" if cross else None)
