"""Readings added after rounds r40-r45 and m32-m33: a constant on one layer's queries that the
other layers of its stack do not carry is a slip in the scale; a cache handed back as it was
handed is stale, and a step written for one query is read; windows declared under other
names, in a wrapper's shared settings, as half-widths or as a band beside a causal mask;
a block that hands its input twice checked as cross-attention; an einsum that writes the
keys' axis first; ALiBi switched on by any flag; fills, bands and softmaxes misread before."""

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check
from attnscope.checking.mistakes.scores import describe_scale
from attnscope.checking.reference import Spec
from attnscope.stages import Kind


class _Scaled(nn.Module):
    """Causal multi-head attention whose queries are multiplied by ``factor`` (by default
    1/sqrt(head_dim): the scale folded into the queries), the scores then scaled by
    1/sqrt(head_dim) where ``scaled``."""

    def __init__(self, d=32, heads=4, factor=None, scaled=False):
        super().__init__()
        self.h, self.hd, self.scaled = heads, d // heads, scaled
        self.factor = self.hd**-0.5 if factor is None else factor
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            f(x).view(b, n, self.h, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        s = (q * self.factor) @ k.transpose(-1, -2)
        if self.scaled:
            s = s * self.hd**-0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _Stack(nn.Module):
    """A small language model of three layers of one class; ``factors[i]`` is layer i's."""

    def __init__(self, factors=(None, None, None), vocab=48, d=32, scaled=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Scaled(d, factor=f, scaled=scaled) for f in factors)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in factors)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, layer in zip(self.norms, self.layers, strict=True):
            x = x + layer(norm(x))
        return self.head(x)


def test_a_constant_on_one_layers_queries_its_siblings_lack_is_a_wrong_scale():
    """THUMT's ``64 // 4 ** -0.5`` (the parentheses lost): layer 2's queries times 128. On
    its own that reads as a muP multiplier; beside two layers of its class without it, it
    is the scale, wrong."""
    report = check(lambda: _Stack((None, None, 128.0)).eval(), kind="causal-multihead")
    assert not report.ok
    assert report.first_layer == "layers.2"
    assert outcome(report) == ("scaled_scores", "wrong_scale")
    assert "by 128 instead of" in report.first_failure.message
    failed = dict(report.layers)["layers.2"]
    assert any("other layers of its stack" in n for n in failed.notes)


def test_one_multiplier_in_every_layer_of_a_stack_stays_a_multiplier():
    """The same constant in every layer, beside the scale, is the model's (muP's): each
    layer passes."""
    report = check(lambda: _Stack((0.7, 0.7, 0.7), scaled=True).eval(), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)


def test_a_fitted_scale_is_named_as_the_round_number_it_is():
    spec = Spec(Kind.of("causal-multihead"), 64, 64, 4)
    assert describe_scale(127.99931, spec, 7) == "128"
    assert describe_scale(0.123456789, spec, 7) == "0.123457"


class _Cached(nn.Module):
    """Causal multi-head attention that appends its keys and values to those it is handed
    and hands them back."""

    def __init__(self, d, heads):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, past=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        s = q @ k.transpose(-1, -2) / self.hd**0.5
        total = k.shape[2]
        later = torch.arange(total)[None, :] > torch.arange(total - n, total)[:, None]
        s = s.masked_fill(later, float("-inf"))
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)), (k, v)


class _States(nn.Module):
    """A Hugging Face-style language model (``past_key_values`` in, presents out) whose
    position is read from the cache's length; ``frozen``: once it is handed a cache it
    hands back that cache, nothing of the new token stored (GluonNLP's states returned as
    they came)."""

    def __init__(self, frozen=False, vocab=48, d=32, heads=4, context=64):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = frozen
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.layers = nn.ModuleList(_Cached(d, heads) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        n = input_ids.shape[1]
        past = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        x = self.tok(input_ids) + self.pos(torch.arange(past, past + n))
        presents = []
        for i, layer in enumerate(self.layers):
            y, kv = layer(x, None if past_key_values is None else past_key_values[i])
            x = x + y
            presents.append(kv)
        if self.frozen and past_key_values is not None:
            presents = past_key_values
        return self.head(x), (presents if use_cache else None)


def test_a_cache_handed_back_unchanged_is_stale_though_a_position_moves_too():
    report = check(lambda: _States(frozen=True).eval())
    d = report.decode
    assert (d.ok, d.mistake, d.step) == (False, "cache_stale", 1)
    assert "step 0 handed back the cache it was handed, unchanged" in d.message


def test_a_cache_handed_back_grown_decodes_as_the_full_pass():
    report = check(lambda: _States().eval())
    assert report.ok and report.decode.ok, report.to_text(color=False)


class _AlibiKeyOffset(nn.Module):
    """Causal ALiBi written per key, ``slope * (j - (n - 1))`` (llm-foundry's row), added
    to the scaled scores; ``fill``: the value the future is filled with afterwards."""

    def __init__(self, d=32, heads=4, fill=-math.inf):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.hd, self.fill = heads, d // heads, fill
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.h + 1, dtype=torch.float64) / self.h)
        bias = slopes[:, None, None] * torch.arange(1 - n, 1, dtype=torch.float64)[None, None]
        s = q @ k.transpose(-1, -2) / self.hd**0.5 + bias.to(x.dtype)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), self.fill)
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


def test_alibi_per_key_with_the_future_filled_with_zero_is_a_fill_value():
    assert check(lambda: _AlibiKeyOffset().eval(), kind="causal-multihead").ok
    report = check(lambda: _AlibiKeyOffset(fill=0.0).eval(), kind="causal-multihead")
    assert outcome(report) == ("masked_scores", "mask_fill_value")


class _Perceiver(nn.Module):
    """Chatterbox's block: one norm for both inputs, the layer handed the normed input
    twice when no second sequence is given (self-attention), else the normed context;
    ``slip``: the keys and values projected from the queries' input all the same."""

    class Attention(nn.Module):
        def __init__(self, d, heads, slip):
            super().__init__()
            self.h, self.slip = heads, slip
            self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.proj_out = nn.Linear(d, d)

        def forward(self, x1, x2):
            b, n, d = x1.shape
            src = x1 if self.slip else x2
            q = self.to_q(x1).view(b, n, self.h, -1).transpose(1, 2)
            k = self.to_k(src).view(b, src.shape[1], self.h, -1).transpose(1, 2)
            v = self.to_v(src).view(b, src.shape[1], self.h, -1).transpose(1, 2)
            ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.proj_out(ctx.transpose(1, 2).reshape(b, n, d))

    def __init__(self, d=32, heads=4, slip=False):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(d)
        self.attn = self.Attention(d, heads, slip)

    def forward(self, x1, x2=None):
        x1_norm = self.norm(x1)
        x2_norm = x1_norm if x2 is None else self.norm(x2)
        return x1 + self.attn(x1_norm, x2_norm)


@pytest.mark.parametrize("slip", [False, True])
def test_a_block_that_hands_its_input_twice_without_a_context_is_checked_as_cross(slip):
    report = check(lambda: _Perceiver(slip=slip).eval(), kind="cross")
    assert outcome(report) == (("keys", "wrong_source") if slip else ("ok",))
    if not slip:
        assert report.structure["cross"] is True


class _EinsumKeysFirst(nn.Module):
    """One fused projection; the scores' einsum names the queries first and writes the
    keys' axis first in its output (``"bhqd,bhkd->bhkq"``) where ``slip``."""

    def __init__(self, d=32, heads=4, slip=False):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.slip = heads, slip
        self.in_proj, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            t.view(b, n, self.h, -1).transpose(1, 2) for t in self.in_proj(x).chunk(3, dim=-1)
        )
        eq = "bhqd,bhkd->bhkq" if self.slip else "bhqd,bhkd->bhqk"
        scores = torch.einsum(eq, q, k) / math.sqrt(d // self.h)
        w = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ctx = torch.einsum("bhqk,bhkd->bhqd", w.softmax(-1), v)
        return self.out_proj(ctx.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("slip", [False, True])
def test_an_einsum_that_writes_the_keys_axis_first_is_scores_transposed(slip):
    """With one fused weight, keys times queries reads the same as the chunks unpacked in
    the wrong order; the einsum's own equation says which it was."""
    report = check(lambda: _EinsumKeysFirst(slip=slip).eval(), kind="causal-multihead")
    assert outcome(report) == (("scores", "scores_transposed") if slip else ("ok",))


class _Recurrent(nn.Module):
    """fast-transformers' way: a batch path for the prompt, and one token at a time with
    a state of keys and values ``(b, heads, keys, e)`` for each step, its scores an
    einsum with no query axis; ``slip``: ``"twice"`` (the new key appended before the
    step appends it again) or ``"temperature"`` (the step scales by 1/sqrt(d_model))."""

    def __init__(self, d, heads, slip):
        super().__init__()
        self.h, self.slip = heads, slip
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, state=None):
        b, n, d = x.shape
        e = d // self.h
        if state is None:  # the batch path: (b, n, heads, e)
            q, k, v = (f(x).view(b, n, self.h, e) for f in (self.q, self.k, self.v))
            s = torch.einsum("nlhe,nshe->nhls", q, k) / math.sqrt(e)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            ctx = torch.einsum("nhls,nshd->nlhd", s.softmax(-1), v)
            return self.o(ctx.reshape(b, n, d)), [k.transpose(1, 2), v.transpose(1, 2)]
        outs = []
        for t in range(n):
            q, k, v = (f(x[:, t]).view(b, self.h, e) for f in (self.q, self.k, self.v))
            if self.slip == "twice":
                state = [
                    torch.cat([s, new[:, :, None]], 2) for s, new in zip(state, (k, v), strict=True)
                ]
            keys, values = (
                torch.cat([s, new[:, :, None]], 2) for s, new in zip(state, (k, v), strict=True)
            )
            temp = d**-0.5 if self.slip == "temperature" else e**-0.5
            a = torch.softmax(temp * torch.einsum("nhe,nhse->nhs", q, keys), dim=-1)
            outs.append(self.o(torch.einsum("nhs,nhsd->nhd", a, values).reshape(b, d)))
            state = [keys, values]
        return torch.stack(outs, 1), state


class _RecurrentLM(nn.Module):
    def __init__(self, slip=None, vocab=48, d=32, heads=4, context=64):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.layers = nn.ModuleList(_Recurrent(d, heads, slip) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        n = input_ids.shape[1]
        past = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        x = self.tok(input_ids) + self.pos(torch.arange(past, past + n))
        states = []
        for i, layer in enumerate(self.layers):
            y, st = layer(x, None if past_key_values is None else past_key_values[i])
            x = x + y
            states.append(st)
        return self.head(x), (states if use_cache else None)


@pytest.mark.parametrize(
    ("slip", "code"), [(None, None), ("twice", "cache_stale"), ("temperature", "cache_other")]
)
def test_a_step_written_for_one_query_is_read_for_what_it_attends_over(slip, code):
    """The step's keys laid out otherwise than the batch path's, its scores with no query
    axis: a key held twice is stale; the same keys, seen alike, weighed with another scale
    is no mask."""
    report = check(lambda: _RecurrentLM(slip).eval())
    assert report.decode.mistake == code, report.decode.message
    if code == "cache_stale":
        assert "held twice" in report.decode.message


class _Band(nn.Module):
    """Samba's sliding-window layer: its config's ``local_window`` keys (the query and
    those before it), kept by a band the layer builds; ``local=False``: a full layer of
    the same model (the config still holds the window). ``band``: ``"right"``, ``"wide"``
    (``i - j <= window``), ``"no_tril"`` (the far past cut, the future not), ``"none"``."""

    class Config:
        local_window = 4

    def __init__(self, band="right", local=True, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.config, self.local, self.band, self.h = self.Config(), local, band, heads
        self.attn, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.attn(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        w = self.config.local_window
        keep = j <= i
        if self.local and self.band == "right":
            keep = keep & (i - j < w)
        elif self.local and self.band == "wide":
            keep = keep & (i - j <= w)
        elif self.local and self.band == "no_tril":
            keep = torch.ones(n, n, dtype=torch.bool).triu(-(w - 1))
        mask = torch.zeros(n, n).masked_fill(~keep, float("-inf")).to(x.dtype)
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(ctx.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("band", "local", "want"),
    [
        ("right", True, ("ok",)),
        ("right", False, ("ok",)),
        ("wide", True, ("masked_scores", "window_size")),
        ("none", True, ("masked_scores", "window_missing")),
        ("no_tril", True, ("masked_scores", "missing_mask")),
    ],
)
def test_a_window_declared_as_local_window_is_held_where_the_layer_is_local(band, local, want):
    report = check(lambda: _Band(band, local).eval(), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if want == ("ok",):
        assert report.structure["window"] == (4 if local else None)


class _Chunked(nn.Module):
    """A causal window of ``w`` keys computed on blocks of ``w`` queries, each with its own
    block's keys and the previous block's, in one product over all the blocks."""

    def __init__(self, d=32, heads=4, w=4):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.w = heads, w
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        w, pad = self.w, (-n) % self.w
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        nb = (n + pad) // w
        qb, kb, vb = (t.reshape(b, self.h, nb, w, -1) for t in (q, k, v))
        prev = [torch.nn.functional.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1] for t in (kb, vb)]
        kk, vv = torch.cat((prev[0], kb), 3), torch.cat((prev[1], vb), 3)
        s = torch.einsum("bhnqd,bhnkd->bhnqk", qb, kk) / math.sqrt(d // self.h)
        qpos = torch.arange(nb * w).view(nb, w)
        kpos = torch.cat((qpos - w, qpos), 1)
        delta = qpos[:, :, None] - kpos[:, None, :]
        s = s.masked_fill(~((delta >= 0) & (delta < w) & (kpos[:, None] >= 0)), float("-inf"))
        y = torch.einsum("bhnqk,bhnkd->bhnqd", s.softmax(-1), vv).reshape(
            b, self.h, -1, d // self.h
        )
        return self.out(y[:, :, :n].transpose(1, 2).reshape(b, n, d))


def test_attention_on_blocks_in_one_product_is_refused_naming_it():
    with pytest.raises(AttnScopeError, match="not supported yet: attention computed on blocks"):
        check(lambda: _Chunked().eval(), kind="causal-multihead")


class _Args:
    """A family's shared settings (YOCO's): its sliding-window models read the window; the
    baseline Transformer built from the same arguments does not."""

    dim, heads, sliding_window = 32, 4, 3


class _FullLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.h = args.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.h, -1).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, n, d))


class _Baseline(nn.Module):
    """The baseline model: it holds the family's arguments and never reads their window."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.args = _Args()
        self.layers = nn.ModuleList([_FullLayer(self.args)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class _Windowed(_Baseline):
    """The same arguments read on the way to the layer: the window is declared, and the
    layer (full causal) leaves it out."""

    def forward(self, x):
        assert self.args.sliding_window > 0  # the model's code names its window
        return super().forward(x)


def test_a_window_the_wrappers_shared_settings_hold_and_no_code_reads_declares_nothing():
    report = check(lambda: _Baseline().eval(), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["window"] is None
    report = check(lambda: _Windowed().eval(), kind="causal-multihead")
    assert outcome(report) == ("masked_scores", "window_missing")


class _AlibiSwitch(nn.Module):
    """A layer whose settings switch ALiBi on by a name of its own (ppl.pmx's
    ``alibi_in_attention``); ``applied``: whether it adds the bias."""

    def __init__(self, applied, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.alibi_in_attention, self.applied, self.h = True, applied, heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        if self.applied:
            slopes = 2.0 ** (-8.0 * torch.arange(1, self.h + 1, dtype=torch.float64) / self.h)
            pos = torch.arange(n, dtype=torch.float64)
            s = s + (slopes[:, None, None] * (pos[None, :] - pos[:, None])).to(x.dtype)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("applied", "want"), [(True, ("ok",)), (False, ("biased_scores", "bias_missing"))]
)
def test_alibi_switched_on_by_any_alibi_flag_is_declared(applied, want):
    report = check(lambda: _AlibiSwitch(applied).eval(), kind="causal-multihead")
    assert outcome(report) == want


class _Band2(nn.Module):
    """A bidirectional local window declared as flash-attn's half-width (``window_size = 3``:
    ``|i - j| <= 3``, 7 keys), built by the layer; ``slip``: ``"strict"`` (``<``, 5 keys),
    ``"zero"`` (the far keys' scores set to 0, not hidden), ``"colmax"`` (a hand-written
    stable softmax taking each key's maximum over the queries)."""

    window_size = 3

    def __init__(self, slip=None, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.slip, self.h = slip, heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
        band = dist < self.window_size if self.slip == "strict" else dist <= self.window_size
        fill = torch.zeros_like(s) if self.slip == "zero" else torch.full_like(s, float("-inf"))
        s = torch.where(band, s, fill)
        if self.slip == "colmax":
            s = s - s.amax(dim=-2, keepdim=True)
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("slip", "want"),
    [
        (None, ("ok",)),
        ("strict", ("masked_scores", "window_size")),
        ("zero", ("masked_scores", "mask_fill_value")),
        ("colmax", ("weights", "not_softmax")),
    ],
)
def test_a_bidirectional_window_declared_as_a_half_width_is_held_to_it(slip, want):
    report = check(lambda: _Band2(slip).eval(), kind="multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if slip is None:
        assert report.structure["window"] == 7


class _FoundryBand(nn.Module):
    """llm-foundry's torch path: the causal mask, then a band ``tril(w) & triu(-w)`` for its
    ``sliding_window_size = w`` (the query and the w keys before it); ``narrow``: the band
    built for ``w - 2`` (a width no reading of the declared one explains)."""

    sliding_window_size = 3

    def __init__(self, narrow=False, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.narrow, self.h = narrow, heads
        self.Wqkv, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.Wqkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        low = torch.finfo(s.dtype).min
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), low)
        w = self.sliding_window_size - (2 if self.narrow else 0)
        band = torch.ones(n, n, dtype=torch.bool).tril(w).triu(-w)
        s = s.masked_fill(~band, low)
        return self.out_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize(
    ("narrow", "want"), [(False, ("ok",)), (True, ("masked_scores", "window_size"))]
)
def test_a_band_on_either_side_beside_a_causal_mask_is_a_causal_window(narrow, want):
    report = check(lambda: _FoundryBand(narrow).eval(), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if not narrow:
        assert report.structure["window"] == 4
