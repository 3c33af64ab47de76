"""Readings asked for by the first runs of rounds 34 on (and by round 33's two-input
decoders, refused when first run): a decoder of vectors whose forward requires the
encoder's output beside its own input; a decoder block whose optional second input runs a
cross-attention layer after its self-attention; a cross layer handed the decoder's own
hidden states where the model's memory belongs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check
from attnscope.checking.report import ModelReport


class _Attention(nn.Module):
    """Multi-head attention over ``(query, key_value)`` (4 heads of 16, width 64):
    ``(batch, tokens, 64), (batch, other, 64) -> (batch, tokens, 64)``."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, query, key_value):
        b, n, _ = query.shape
        m = key_value.shape[1]
        q = self.q(query).view(b, n, 4, 16).transpose(1, 2)
        k = self.k(key_value).view(b, m, 4, 16).transpose(1, 2)
        v = self.v(key_value).view(b, m, 4, 16).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


class _DecoderLayer(nn.Module):
    """Causal self-attention, then cross-attention over ``memory`` (pre-norm residuals);
    ``pasted``: the cross layer handed the normed target where the memory belongs (the
    self-attention call's arguments pasted)."""

    def __init__(self, pasted: bool = False):
        super().__init__()
        self.pasted = pasted
        self.self_attn, self.src_attn = _Attention(True), _Attention(False)
        self.norm1, self.norm2 = nn.LayerNorm(64), nn.LayerNorm(64)

    def forward(self, tgt, memory):
        t = self.norm1(tgt)
        x = tgt + self.self_attn(t, t)
        return x + self.src_attn(self.norm2(x), t if self.pasted else memory)


class _Decoder(nn.Module):
    """Two decoder layers over vectors; the encoder's output is required."""

    def __init__(self, pasted_in: int | None = None):
        super().__init__()
        torch.manual_seed(34)
        self.layers = nn.ModuleList(_DecoderLayer(i == pasted_in) for i in range(2))

    def forward(self, tgt, memory):
        for layer in self.layers:
            tgt = layer(tgt, memory)
        return tgt


class _Block(nn.Module):
    """One decoder block whose encoder states are optional (Hugging Face's habit): without
    them it is self-attention only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(35)
        self.self_attn, self.encoder_attn = _Attention(True), _Attention(False)

    def forward(self, hidden_states, encoder_hidden_states=None):
        x = hidden_states + self.self_attn(hidden_states, hidden_states)
        if encoder_hidden_states is not None:
            x = x + self.encoder_attn(x, encoder_hidden_states)
        return x


def _layers(report) -> dict:
    assert isinstance(report, ModelReport), report.to_text(color=False)
    return {path: (r.ok, r.kind) for path, r in report.layers}


@pytest.mark.parametrize("kind", [None, "cross"])
def test_a_decoder_that_requires_the_encoders_output_is_checked_layer_by_layer(kind):
    """The second required input is handed a sequence of its own (longer than the input):
    each layer is checked where it sits, the self-attention causal, the other cross; with
    --kind cross, the kind applies to the cross layers and the others' is read."""
    report = check(_Decoder(), kind=kind)
    assert report.ok, report.to_text(color=False)
    assert _layers(report) == {
        "layers.0.self_attn": (True, "causal-multihead"),
        "layers.0.src_attn": (True, "cross"),
        "layers.1.self_attn": (True, "causal-multihead"),
        "layers.1.src_attn": (True, "cross"),
    }
    assert report.layers[1][1].structure["cross"] is True


def test_a_cross_layer_handed_the_decoders_own_states_reads_keys_from_the_wrong_source():
    """Layer 1's cross-attention is handed the normed target where the memory belongs: what
    it reads does not change with the memory, so its keys come from the wrong source."""
    report = check(_Decoder(pasted_in=1))
    assert not report.ok
    assert report.first_layer == "layers.1.src_attn"
    failure = report.first_failure
    assert (failure.stage.value, failure.mistake) == ("keys", "wrong_source")
    assert "'memory'" in failure.message
    assert _layers(report)["layers.0.src_attn"] == (True, "cross")


@pytest.mark.parametrize("kind", [None, "cross"])
def test_a_block_whose_optional_encoder_states_run_cross_attention_is_checked_as_two(kind):
    """Without its optional second input the block runs self-attention alone; handed one, a
    second layer reads it: both are checked, the second as cross-attention (it was the
    first alone, or refused with --kind cross)."""
    report = check(_Block(), kind=kind)
    assert report.ok, report.to_text(color=False)
    assert _layers(report) == {
        "self_attn": (True, "causal-multihead"),
        "encoder_attn": (True, "cross"),
    }


class _JoinedMemory(nn.Module):
    """Keys and values over the memory joined before the tokens (Transformer-XL's
    ``cat([mems, h])``), inside the layer: ``(batch, tokens, 64), (batch, memory, 64)``."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x, mems):
        b, n, _ = x.shape
        joined = torch.cat([mems, x], dim=1)
        m = joined.shape[1]
        q = self.q(x).view(b, n, 4, 16).transpose(1, 2)
        k = self.k(joined).view(b, m, 4, 16).transpose(1, 2)
        v = self.v(joined).view(b, m, 4, 16).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


class _JoinedMemoryModel(nn.Module):
    """Two such layers; the memory is required (``joined_outside``: each layer is a cross
    layer handed the joined sequence by its parent)."""

    def __init__(self, joined_outside: bool = False):
        super().__init__()
        torch.manual_seed(36)
        self.joined_outside = joined_outside
        self.layers = nn.ModuleList(
            _Attention(False) if joined_outside else _JoinedMemory() for _ in range(2)
        )

    def forward(self, x, mems):
        for layer in self.layers:
            x = x + (layer(x, torch.cat([mems, x], 1)) if self.joined_outside else layer(x, mems))
        return x


@pytest.mark.parametrize("target", [_JoinedMemory, _JoinedMemoryModel])
def test_keys_over_a_memory_joined_to_the_tokens_are_refused_not_judged(target):
    """Neither self- nor cross-attention as modelled: a correct layer of this kind was
    failed at its context; it is refused, naming the join."""
    with pytest.raises(
        AttnScopeError,
        match="not supported yet: the keys made from the input joined to another sequence",
    ):
        check(target())


def test_a_layer_handed_a_sequence_joined_by_its_parent_is_cross_attention_over_it():
    """Joined by the model, the sequence a layer's keys read is simply its other input:
    the layer computes cross-attention over it, and is checked as such (the join is the
    model's, whose own output is not held to a reference)."""
    report = check(_JoinedMemoryModel(joined_outside=True))
    assert report.ok, report.to_text(color=False)
    assert _layers(report) == {"layers.0": (True, "cross"), "layers.1": (True, "cross")}


class _Multiplied(nn.Module):
    """Causal attention, 4 heads of 16, whose keys are multiplied by ``factor`` on their way
    to the scores (Falcon-H1's muP ``key_multiplier``), the scores then scaled by
    ``scale`` (1/sqrt(16) where None)."""

    def __init__(self, factor: float, scale: float | None = None):
        super().__init__()
        torch.manual_seed(37)
        self.factor, self.scale = factor, 0.25 if scale is None else scale
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, 4, 16).transpose(1, 2) for p in (self.q, self.k, self.v))
        k = k * self.factor
        s = (q @ k.transpose(-1, -2)) * self.scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 64))


def test_a_constant_multiplier_on_the_keys_that_is_no_power_of_a_size_is_the_weights():
    """Falcon-H1's key_multiplier (0.390625) is part of the keys' weights, not a wrong scale
    (a false alarm on the correct layer); the note says how it was read."""
    report = check(_Multiplied(0.390625), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    assert any("0.390625" in n and "muP" in n for n in report.notes), report.notes


@pytest.mark.parametrize(("factor", "scale"), [(0.25, 0.25), (0.390625, 1 / 8)])
def test_the_scale_applied_twice_or_wrong_beside_a_multiplier_is_still_wrong_scale(factor, scale):
    """A factor that is a power of the sizes (1/sqrt(d_k) on the keys, then again on the
    scores) is the scale applied twice; beside a muP multiplier, a scale of 1/sqrt(d_in)
    is still a wrong one."""
    report = check(_Multiplied(factor, scale), kind="causal-multihead")
    assert outcome(report) == ("scaled_scores", "wrong_scale"), report.to_text(color=False)


class _KeysFromNormedQueries(nn.Module):
    """Cross-attention whose keys and values read ``norm(x)``, the queries' own input normed,
    where ``norm(context)`` belongs (V-JEPA 2's pooler block, pasted)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(38)
        self.q, self.kv, self.o = nn.Linear(64, 64), nn.Linear(64, 128), nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)

    def forward(self, x, context):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 16).transpose(1, 2)
        k, v = self.kv(self.norm(x)).view(b, n, 2, 4, 16).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


def test_keys_and_values_from_a_transform_of_the_queries_input_read_from_the_wrong_source():
    """The keys' projection reads a norm of the queries' input, not the context: the
    ``wrong_source`` reading takes that tensor as what the keys were projected from."""
    report = check(_KeysFromNormedQueries(), kind="cross")
    assert outcome(report) == ("keys", "wrong_source"), report.to_text(color=False)


class _LargeBase(nn.Module):
    """Causal rotary attention (halves pairing, 4 heads of 16) with base 1e11 (Falcon-H1's):
    its last pairs turn by about 1e-10 a position."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(39)
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        inv = 1e11 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
        cos, sin = (torch.cat((t, t), -1).to(x.dtype) for t in (ang.cos(), ang.sin()))

        def turn(t):
            return t * cos + torch.cat((-t[..., 8:], t[..., :8]), -1) * sin

        y = nn.functional.scaled_dot_product_attention(turn(q), turn(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


def test_a_base_whose_slowest_pairs_read_as_noise_is_still_read():
    """Base 1e11: the slowest pairs' rates read as noise about zero (one below it); the base
    is fitted on the pairs that turn measurably, the rest held below the noise."""
    report = check(_LargeBase())
    assert report.ok, report.to_text(color=False)
    assert report.structure["rope"] == {"pairing": "half", "fraction": 1.0, "base": 1e11}


def test_a_passing_report_walks_the_modern_stages_the_layer_has():
    """A correct rotary layer's report lists its rotated queries and keys among the checks
    (they were listed only where one failed); a layer without them lists none."""
    stages = [c.stage.value for c in check(_LargeBase()).checks]
    assert stages[:5] == ["queries", "keys", "values", "rotated_queries", "rotated_keys"]
    assert all(c.ok for c in check(_LargeBase()).checks)
    plain = [c.stage.value for c in check(_Multiplied(0.390625)).checks]
    assert not [s for s in plain if s.startswith(("rotated", "normed", "biased"))]


class _ChunkedQVK(nn.Module):
    """CodeGen / MOSS-style: one combined projection cut into 4 chunks (one per head), each
    holding that head's queries, values and keys in that order; causal by a boolean buffer
    and ``torch.where`` with the dtype's minimum. ``slip``: "diagonal" (the buffer built
    with ``tril(diagonal=-1)``: each token hides itself, the first row hides everything)."""

    def __init__(self, slip: str | None = None):
        super().__init__()
        torch.manual_seed(40)
        self.slip = slip
        self.qkv_proj, self.out_proj = nn.Linear(64, 192, bias=False), nn.Linear(64, 64)
        below = -1 if slip == "diagonal" else 0
        self.register_buffer("causal", torch.ones(64, 64, dtype=torch.bool).tril(below))

    def forward(self, x):
        b, n, _ = x.shape
        q, v, k = self.qkv_proj(x).view(b, n, 4, 48).split(16, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s = k @ q.transpose(-1, -2) if self.slip == "transposed" else q @ k.transpose(-1, -2)
        s = s / 4.0
        s = torch.where(self.causal[:n, :n], s, torch.finfo(s.dtype).min)
        y = s.softmax(-1) @ v
        return self.out_proj(y.transpose(1, 2).reshape(b, n, 64))


@pytest.mark.parametrize(
    ("slip", "want"),
    [
        (None, ("ok",)),
        ("diagonal", ("masked_scores", "mask_diagonal")),
    ],
)
def test_chunks_of_queries_values_keys_are_told_from_a_per_head_reading(slip, want):
    """Read per head as [q|k|v], the chunks show queries, keys and values too (the keys and
    values exchanged): the reading whose later stages the record shows is judged, or
    failing that the one a known mistake explains (round 35's MOSS files: a rotation with
    the wrong pairing shows no later stage in either). A row whose every key is hidden by a
    finite fill weighs every key alike (the slip was context/other)."""
    report = check(_ChunkedQVK(slip), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)


class _OneGroupFiveAxes(nn.Module):
    """uni2ts / Moirai-style multi-query attention with heads on two axes: queries
    ``(b, groups=1, 4, tokens, 16)``, keys and values ``(b, 1, 1, tokens, 16)``, per-head
    RMSNorm on both, then interleaved rotary (base 1e4)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(41)
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(64, 16)
        self.o = nn.Linear(64, 64)
        self.q_gain, self.k_gain = (nn.Parameter(torch.rand(16) + 0.5) for _ in range(2))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 1, 4, 16).permute(0, 2, 3, 1, 4)
        k = self.k(x).view(b, n, 1, 1, 16).permute(0, 2, 3, 1, 4)
        v = self.v(x).view(b, n, 1, 1, 16).permute(0, 2, 3, 1, 4)

        def rms(t, g):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * g

        inv = 1e4 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
        cos, sin = (t.repeat_interleave(2, -1).to(x.dtype) for t in (ang.cos(), ang.sin()))

        def turn(t):
            pair = torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)
            return t * cos + pair * sin

        q, k = turn(rms(q, self.q_gain)), turn(rms(k, self.k_gain))
        s = q @ k.transpose(-1, -2) / 4.0
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        y = s.softmax(-1) @ v  # (b, 1, 4, n, 16)
        return self.o(y.permute(0, 3, 1, 2, 4).reshape(b, n, 64))


def test_one_key_value_group_on_two_head_axes_is_read_under_a_qk_norm():
    """The keys ``(b, 1, 1, tokens, d)``, both head axes of size one, are read as one head
    (they were not, and the correct layer of m28's MQA models was refused as a rotation not
    read)."""
    report = check(_OneGroupFiveAxes())
    assert report.ok, report.to_text(color=False)
    assert (report.structure["heads"], report.structure["kv_heads"]) == (4, 1)
    assert report.structure["rope"]["pairing"] == "interleaved"


class _Tempered(nn.Module):
    """Rotary attention whose queries are then multiplied by a factor of their position
    (Llama 4's attention temperature tuning: ``log(floor((p + 1) / 4) + 1) * 0.1 + 1``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(42)
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        inv = 1e4 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
        cos, sin = (torch.cat((t, t), -1).to(x.dtype) for t in (ang.cos(), ang.sin()))

        def turn(t):
            return t * cos + torch.cat((-t[..., 8:], t[..., :8]), -1) * sin

        pos = torch.arange(n, dtype=x.dtype)
        temper = torch.log(torch.floor((pos + 1) / 4) + 1) * 0.1 + 1
        q = turn(q) * temper[None, None, :, None]
        y = nn.functional.scaled_dot_product_attention(q, turn(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


def test_a_temperature_by_position_on_the_queries_is_refused_naming_it():
    """A factor the same for every feature that changes with the position is named as
    what it is, not as a rotation the checker could not read."""
    with pytest.raises(
        AttnScopeError,
        match="not supported yet: a factor on the queries that changes with the position",
    ):
        check(_Tempered())


# ---------------------------------------------------------------------- round 36's readings


class _TalkingCross(nn.Module):
    """Cross-attention whose scores are mixed across its 4 heads by a learned matrix before
    the softmax (talking heads): ``(batch, tokens, 64), (batch, other, 64)``."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(64, 64), nn.Linear(64, 128), nn.Linear(64, 64)
        self.talk = nn.Parameter(torch.eye(4) + 0.1 * torch.randn(4, 4))

    def forward(self, x, c):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 16).transpose(1, 2)
        k, v = self.kv(c).view(b, c.shape[1], 2, 4, 16).permute(2, 0, 3, 1, 4)
        s = torch.einsum("bhnm,hg->bgnm", q @ k.transpose(-1, -2) / 4.0, self.talk)
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 64))


class _OwnSource(_Attention):
    """A cross layer handed ``(x, c)`` that projects its keys and values from ``x``."""

    def forward(self, query, key_value):
        return super().forward(query, query)


class _SelfThenCross(nn.Module):
    """RDT-style block requiring its condition ``c``: self-attention over the tokens (called
    ``attn(norm(x), norm(x))``: two tensors of one value), then cross-attention over ``c``
    (``talking``: the cross layer's scores mixed across heads; ``own``: the cross layer,
    handed ``c``, projects its keys and values from the tokens)."""

    def __init__(self, talking: bool = False, own: bool = False):
        super().__init__()
        torch.manual_seed(43)
        self.attn = _Attention(False)
        cross = _TalkingCross if talking else _OwnSource if own else _Attention
        self.cross_attn = cross() if talking else cross(False)
        self.norm1, self.norm2 = nn.LayerNorm(64), nn.LayerNorm(64)

    def forward(self, x, c, mask=None):
        x = x + self.attn(self.norm1(x), self.norm1(x))
        return x + self.cross_attn(self.norm2(x), c)


@pytest.mark.parametrize("kind", [None, "cross"])
def test_a_block_requiring_its_condition_is_checked_as_both_layers(kind):
    """The block requires its second sequence: its self-attention is not judged as the
    cross layer (with --kind cross it had been failed at keys/wrong_source), nor taken for
    one because it is handed two equal copies of its input."""
    report = check(_SelfThenCross(), kind=kind)
    assert report.ok, report.to_text(color=False)
    assert _layers(report) == {"attn": (True, "multihead"), "cross_attn": (True, "cross")}


@pytest.mark.parametrize("kind", [None, "cross"])
def test_talking_heads_in_a_cross_layer_after_another_layer_are_refused(kind):
    """Scores mixed across heads by a learned map, in a layer whose queries come from an
    earlier layer's output: the map was taken for that context being projected, the core
    lost, and the block given a verdict (keys/wrong_source with --kind cross; ok without)."""
    with pytest.raises(AttnScopeError, match="mixed across heads by a learned map"):
        check(_SelfThenCross(talking=True), kind=kind)


@pytest.mark.parametrize("kind", [None, "cross"])
def test_the_condition_handed_to_a_layer_that_never_reads_it_is_wrong_source(kind):
    """The block hands its cross layer the condition it requires, and the layer's keys read
    the tokens instead: the condition is a sequence the model requires, so the layer is
    cross-attention reading the wrong source, whatever the argument is called (it passed,
    as self-attention beside an idle argument)."""
    report = check(_SelfThenCross(own=True), kind=kind)
    assert report.first_layer == "cross_attn", report.to_text(color=False)
    assert outcome(report) == ("keys", "wrong_source"), report.to_text(color=False)


class _FoldedAlibi(nn.Module):
    """SASRec-style: heads stacked on the batch axis head-major (``cat(chunk(Q, H), 0)``),
    ALiBi's ``-slope_h * |i - j|`` repeated likewise, causal by ``tril`` and ``torch.where``
    with ``fill`` (SASRec's ``-2 ** 32 + 1``)."""

    def __init__(self, fill: float = -(2.0**32) + 1):
        super().__init__()
        torch.manual_seed(44)
        self.fill = fill
        self.Q, self.K, self.V = (nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (torch.cat(torch.chunk(p(x), 4, dim=2), dim=0) for p in (self.Q, self.K, self.V))
        s = torch.bmm(q, k.transpose(1, 2)) / 4.0
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / 4) for h in range(4)], dtype=x.dtype)
        pos = torch.arange(n, dtype=x.dtype)
        bias = -slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()
        s = s + bias.repeat_interleave(b, dim=0)
        tril = torch.ones(n, n, dtype=torch.bool).tril()
        s = torch.where(tril, s, torch.full_like(s, self.fill))
        y = torch.bmm(s.softmax(-1), v)
        return torch.cat(torch.chunk(y, 4, dim=0), dim=2)


@pytest.mark.parametrize(
    ("fill", "want"),
    [(-(2.0**32) + 1, ("ok",)), (2.0**32 + 1, ("masked_scores", "mask_fill_value"))],
)
def test_alibi_on_heads_stacked_head_major_and_a_fill_whose_sign_is_dropped(fill, want):
    """The bias on the folded (heads x batch) axis is read head-major (it was refused as a
    bias that is not ALiBi's); a fill of +2**32 (the minus sign dropped) gives every hidden
    key all the weight, a wrong fill (it was scores/not_dot_product)."""
    report = check(_FoldedAlibi(fill), kind="causal-multihead")
    assert outcome(report) == want, report.to_text(color=False)
    if want == ("ok",):
        assert report.structure["bias"] == "alibi"


class _PackedCross(nn.Module):
    """Cross-attention with one packed ``in_proj_weight`` chunked into q, k and v (torch's
    ``nn.MultiheadAttention`` layout, written out as Diffusion Policy's is), 4 heads of 16.
    ``slip``: "no_out" (the merged heads returned without ``out_proj``) or "keys_wq" (the
    keys projected from the context with the query chunk)."""

    def __init__(self, slip: str | None = None):
        super().__init__()
        torch.manual_seed(45)
        self.slip = slip
        self.in_proj_weight = nn.Parameter(torch.randn(192, 64) * 0.1)
        self.in_proj_bias = nn.Parameter(torch.rand(192) * 0.4 - 0.2)
        self.out_proj = nn.Linear(64, 64)

    def forward(self, x, context):
        b, n, _ = x.shape
        m = context.shape[1]
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = nn.functional.linear(x, w_q, b_q)
        if self.slip == "keys_wq":
            k = nn.functional.linear(context, w_q, b_q)
        else:
            k = nn.functional.linear(context, w_k, b_k)
        v = nn.functional.linear(context, w_v, b_v)
        q, k, v = (t.view(b, -1, 4, 16).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        y = y.reshape(b, n, 64)
        assert k.shape[2] == m
        return y if self.slip == "no_out" else self.out_proj(y)


@pytest.mark.parametrize(
    ("slip", "want"),
    [
        (None, ("ok",)),
        ("no_out", ("output", "missing_out_proj")),
        ("keys_wq", ("keys", "wrong_projection")),
    ],
)
def test_a_packed_cross_layers_chunks_are_no_doubled_projection(slip, want):
    """q, k and v read different chunks of one parameter: that is no role made twice with
    one weight, so an idle ``out_proj`` is the skipped output projection (it passed); keys
    made from the context with the query chunk are ``wrong_projection`` (keys/other)."""
    report = check(_PackedCross(slip), kind="cross")
    assert outcome(report) == want, report.to_text(color=False)


class _CachedLayer(nn.Module):
    """Causal attention (4 heads of 16) with a ``(keys, values)`` cache concatenated on the
    tokens' axis; ``twice``: a one-token step stores its key and value twice."""

    def __init__(self, twice: bool):
        super().__init__()
        self.twice = twice
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x, past=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        stored = (k, v)
        if self.twice and past is not None and n == 1:
            stored = (torch.cat([k, k[:, :, -1:]], 2), torch.cat([v, v[:, :, -1:]], 2))
        mask = torch.ones(n, k.shape[2], dtype=torch.bool).tril(k.shape[2] - n)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, 64)), stored


class _TwiceStored(nn.Module):
    """A two-layer causal LM with a Hugging Face-style cache, learned positions counted
    from the cache's length (``twice``: see :class:`_CachedLayer`)."""

    def __init__(self, twice: bool = False):
        super().__init__()
        torch.manual_seed(46)
        self.emb, self.pos = nn.Embedding(96, 64), nn.Embedding(64, 64)
        self.layers = nn.ModuleList(_CachedLayer(twice) for _ in range(2))
        self.head = nn.Linear(64, 96)

    def forward(self, ids, past_key_values=None, use_cache=False):
        n = ids.shape[1]
        start = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        x = self.emb(ids) + self.pos(torch.arange(start, start + n))
        presents = []
        for i, layer in enumerate(self.layers):
            y, stored = layer(x, None if past_key_values is None else past_key_values[i])
            x = x + y
            presents.append(stored)
        return SimpleNamespace(logits=self.head(x), past_key_values=presents if use_cache else None)


@pytest.mark.parametrize("twice", [False, True])
def test_a_cache_updated_twice_is_stale_though_the_positions_move_with_it(twice):
    """Stored twice, the cache is one entry longer than the tokens from the first step on,
    so the position the model counts from its length is off and the first layer's input
    already differs: the overfull cache is the finding, cache_stale (it was named
    cache_positions)."""
    report = check(_TwiceStored(twice))
    assert report.decode is not None
    if not twice:
        assert report.ok, report.to_text(color=False)
        return
    assert report.decode.mistake == "cache_stale", report.to_text(color=False)
    assert report.decode.step == 1
