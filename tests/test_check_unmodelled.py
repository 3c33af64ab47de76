"""attnscope check on operations the reference does not model, and on layouts it reads
through: a layer whose output no reading and no known mistake explains is refused naming
the operation it does that the checker cannot follow (cosine attention, a learned factor on
the scores, bias key/value rows, a 2-D rotary, chunked masks), never given a verdict; a
position bias added to scores laid out sequence-first is read as ALiBi and its slopes and
sign judged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnscope import AttnScopeError, check
from attnscope.functional import alibi_slopes


class _SeqFirst(nn.Module):
    """Sequence-first ``(T, B, d)`` attention with scores laid out ``[i, j, b, h]`` (labml's
    einsum style), a boolean causal mask ``[i, j, 1, 1]``, and an optional ALiBi bias."""

    def __init__(
        self, heads=4, d=32, alibi=False, slopes=None, sign=1.0, softmax_dim=1, causal=True
    ):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.dk = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.alibi, self.sign, self.softmax_dim = alibi, sign, softmax_dim
        self.causal = causal
        self.register_buffer("slopes", alibi_slopes(heads).float() if slopes is None else slopes)

    def forward(self, x):  # (T, B, d)
        t, b, _ = x.shape
        q = self.q(x).view(t, b, self.h, self.dk)
        k = self.k(x).view(t, b, self.h, self.dk)
        v = self.v(x).view(t, b, self.h, self.dk)
        scores = torch.einsum("ibhd,jbhd->ijbh", q, k) / math.sqrt(self.dk)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[:, :, None, None]
        if self.alibi and self.causal:  # the key-position form: slope * (j + 1), causal
            distance = mask[:, :, 0, 0].to(x.dtype).cumsum(-1)
            scores = scores + self.sign * distance[:, :, None, None] * self.slopes
        elif self.alibi:  # bidirectional: -slope * |i - j|, subtracted
            pos = torch.arange(t, dtype=x.dtype)
            distance = (pos[None, :] - pos[:, None]).abs()
            scores = scores - self.sign * distance[:, :, None, None] * self.slopes
        if self.causal:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = scores.softmax(dim=self.softmax_dim)
        return self.o(torch.einsum("ijbh,jbhd->ibhd", attn, v).reshape(t, b, -1))


class _BatchFirst(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.transpose(0, 1)).transpose(0, 1)


def _outcome(report):
    if report.ok:
        return ("ok",)
    return (report.first_failure.stage.value, report.first_failure.mistake)


def test_sequence_first_alibi_passes_and_its_slopes_and_sign_are_judged():
    assert _outcome(check(lambda: _BatchFirst(_SeqFirst(alibi=True)))) == ("ok",)
    two_alike = torch.tensor([0.25, 0.0625, 0.25, 0.5])  # not the geometric slopes
    wrong = check(lambda: _BatchFirst(_SeqFirst(alibi=True, slopes=two_alike)))
    assert _outcome(wrong) == ("biased_scores", "bias_slopes"), wrong.to_text(color=False)
    flipped = check(lambda: _BatchFirst(_SeqFirst(alibi=True, sign=-1.0)))
    assert _outcome(flipped) == ("biased_scores", "bias_sign"), flipped.to_text(color=False)


def test_sequence_first_bidirectional_alibi_subtracted_passes_and_its_sign_is_judged():
    report = check(lambda: _BatchFirst(_SeqFirst(alibi=True, causal=False)))
    assert _outcome(report) == ("ok",), report.to_text(color=False)
    assert report.structure["bias"] == "alibi"
    flipped = check(lambda: _BatchFirst(_SeqFirst(alibi=True, causal=False, sign=-1.0)))
    assert _outcome(flipped) == ("biased_scores", "bias_sign"), flipped.to_text(color=False)


def test_sequence_first_mask_is_read_so_a_softmax_over_the_queries_is_named():
    report = check(lambda: _BatchFirst(_SeqFirst(softmax_dim=0)))  # the kind inferred
    assert report.kind == "causal-multihead", report.kind_reason
    assert _outcome(report) == ("weights", "softmax_wrong_dim"), report.to_text(color=False)


class _Cosine(nn.Module):
    """Cosine attention (Swin v2, open_clip's scaled_cosine): q and k normalised to unit
    length, times a learned per-head logit scale; with ``normalise=False`` only the factor."""

    def __init__(self, d=32, heads=4, normalise=True, temperature=None):
        super().__init__()
        torch.manual_seed(1)
        self.h, self.normalise = heads, normalise
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        scales = torch.tensor([4.0, 8.0, 16.0, 30.0]).view(heads, 1, 1)
        if temperature is not None:  # one fixed temperature for every head
            scales = torch.tensor(float(temperature))
        self.logit_scale = nn.Parameter(torch.log(scales))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        if self.normalise:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        else:
            q = q * q.shape[-1] ** -0.5
        scores = q @ k.transpose(-1, -2) * self.logit_scale.exp()
        ctx = scores.softmax(-1) @ v
        return self.out(ctx.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("temperature", [None, 10.0])
def test_cosine_attention_is_refused_not_judged(temperature):
    """Per-head logit scales reproduce no scores; one temperature for all heads would read
    as a wrong scale: both are cosine attention's design, refused."""
    with pytest.raises(AttnScopeError, match="not supported yet: cosine attention") as info:
        check(lambda: _Cosine(temperature=temperature), kind="multihead")
    assert "test_check_unmodelled.py:" in str(info.value)


def test_a_learned_factor_on_the_scores_is_refused_not_judged():
    with pytest.raises(AttnScopeError, match="not supported yet: a learned factor multiplying"):
        check(lambda: _Cosine(normalise=False), kind="multihead")


class _BiasKV(nn.Module):
    """add_bias_kv written out: a learned key row and value row joined to every sequence."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        torch.manual_seed(2)
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.bias_k = nn.Parameter(torch.randn(1, 1, d))
        self.bias_v = nn.Parameter(torch.randn(1, 1, d))

    def forward(self, x):
        b, t, d = x.shape
        k = torch.cat([self.k(x), self.bias_k.expand(b, 1, d)], dim=1)
        v = torch.cat([self.v(x), self.bias_v.expand(b, 1, d)], dim=1)
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        k = k.view(b, t + 1, self.h, -1).transpose(1, 2)
        v = v.view(b, t + 1, self.h, -1).transpose(1, 2)
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, t, d))


def test_bias_key_value_rows_are_refused_not_judged():
    with pytest.raises(AttnScopeError, match="not supported yet: learned bias key/value rows"):
        check(lambda: _BiasKV(), kind="multihead")


@pytest.mark.parametrize(
    "flag,words", [("add_bias_kv", "bias key/value rows"), ("add_zero_attn", "zero key/value")]
)
def test_torch_multihead_attention_with_extra_key_value_rows_is_refused(flag, words):
    def make():
        torch.manual_seed(3)
        return nn.MultiheadAttention(32, 4, batch_first=True, **{flag: True}).eval()

    with pytest.raises(AttnScopeError, match=f"not supported yet: .*{words}"):
        check(make)


class _Rope2D(nn.Module):
    """A 2-D rotary: tokens on a grid three wide, rows turning half of each head's pairs and
    columns the other half (EVA-02's vision rotary, without its [CLS] token)."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        torch.manual_seed(4)
        self.h = heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        hd = q.shape[-1]
        pos = torch.arange(t, dtype=x.dtype)
        freqs = 1.0 / 100 ** (torch.arange(hd // 4, dtype=x.dtype) / (hd // 4))
        ang = torch.cat([(pos // 3)[:, None] * freqs, (pos % 3)[:, None] * freqs], -1)
        ang = torch.cat([ang, ang], -1)  # halves

        def rotate(u):
            u1, u2 = u.chunk(2, -1)
            return u * ang.cos() + torch.cat([-u2, u1], -1) * ang.sin()

        q, k = rotate(q), rotate(k)
        w = (q @ k.transpose(-1, -2) / math.sqrt(hd)).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, t, d))


def test_a_2d_rotary_is_refused_not_judged():
    with pytest.raises(AttnScopeError, match="not supported yet: rotary") as info:
        check(lambda: _Rope2D(), kind="multihead")
    assert "test_check_unmodelled.py:" in str(info.value)


class _Chunked(nn.Module):
    """Causal attention within chunks of 8 tokens (Llama 4's chunked attention), the mask
    built from the sequence length: the same as causal up to 8 tokens."""

    def __init__(self, d=32, heads=4, chunk=8):
        super().__init__()
        torch.manual_seed(5)
        self.h, self.chunk = heads, chunk
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(t)
        seen = (i[None, :] <= i[:, None]) & (i[None, :] // self.chunk == i[:, None] // self.chunk)
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


def test_chunked_attention_is_refused_even_where_the_probe_is_shorter_than_a_chunk():
    with pytest.raises(AttnScopeError, match="not supported yet: chunked attention"):
        check(lambda: _Chunked())
    with pytest.raises(AttnScopeError, match="chunks? of 3 tokens"):
        check(lambda: _Chunked(chunk=3), kind="causal-multihead")


class _Gated(nn.Module):
    """Multi-head attention whose context is gated by the input before the output
    projection (AlphaFold's ``gating=True``, Qwen3-Next): ``sigmoid(W_g x) * context``;
    ``scale`` instead multiplies it by a learned per-feature vector (a LayerScale, which is
    no function of the input)."""

    def __init__(self, d=32, heads=4, gate=True):
        super().__init__()
        self.h, self.gate = heads, gate
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.g = nn.Linear(d, d) if gate else None
        self.scale = None if gate else nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.h), dim=-1)
        ctx = (w @ v).transpose(1, 2).reshape(b, n, d)
        ctx = torch.sigmoid(self.g(x)) * ctx if self.gate else self.scale * ctx
        return self.o(ctx)


@pytest.mark.parametrize(
    "gate,words", [(True, "an output gate"), (False, "a factor that varies by feature")]
)
def test_a_gate_or_a_learned_scale_on_the_context_is_refused_naming_it(gate, words):
    """Neither is a stage the reference models (the scale could be folded into the output
    projection, which the reference does not do): refused by name, never judged."""
    torch.manual_seed(0)
    with pytest.raises(AttnScopeError, match=f"not supported yet: {words}"):
        check(lambda: _Gated(gate=gate))
