"""A learned relative position bias (T5's buckets, Tortoise's, MPNet's) is modelled: the
reference adds what the layer adds, read back at each length, and the rest of the layer is
judged around it; a learned bias that is no relative one stays refused."""

import pytest
import torch
from conftest import outcome
from torch import nn
from torch.nn import functional as F

from attnscope import AttnScopeError, check
from attnscope.checking.relbias import relative_table


class _Relative(nn.Module):
    """Multi-head attention with a learned bias per head and clipped offset ``j - i``
    (offsets beyond ``reach`` share a value), added to the scaled scores; ``slip`` plants one
    mistake."""

    def __init__(self, d=32, heads=4, reach=3, causal=False, slip=None, scaled=True, sdpa=False):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.reach, self.causal, self.slip = heads, reach, causal, slip
        self.scaled, self.sdpa = scaled, sdpa
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.table = nn.Embedding(2 * reach + 1, heads)

    def bias(self, n):
        pos = torch.arange(n)
        offset = (pos[None, :] - pos[:, None]).clamp(-self.reach, self.reach) + self.reach
        return self.table(offset).permute(2, 0, 1)  # (heads, n, n)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        bias = self.bias(n).to(x.dtype)
        if self.causal:
            bias = bias.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        if self.sdpa:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            s = q @ k.transpose(-1, -2)
            if self.scaled:
                s = s / (d // self.h) ** 0.5
            s = s + bias
            w = s.softmax(dim=-2 if self.slip == "softmax_dim" else -1)
            ctx = w @ v
        return self.out(ctx.transpose(1, 2).reshape(b, n, d))


def test_a_learned_relative_bias_is_judged_and_named_learned():
    report = check(lambda: _Relative().eval())
    assert report.ok, report.to_text(color=False)
    assert report.structure["bias"] == "learned"
    assert "biased_scores" in [c.stage for c in report.checks]


def test_a_learned_relative_bias_beside_a_causal_mask_and_through_sdpa():
    report = check(lambda: _Relative(causal=True, sdpa=True).eval())
    assert report.ok, report.to_text(color=False)
    assert report.structure["bias"] == "learned" and report.structure["causal"]


def test_a_slip_elsewhere_in_a_layer_with_a_learned_bias_is_named():
    report = check(lambda: _Relative(slip="softmax_dim").eval())
    assert outcome(report) == ("weights", "softmax_wrong_dim"), report.to_text(color=False)


def test_unscaled_scores_beside_a_learned_bias_read_as_t5s_convention_and_said():
    report = check(lambda: _Relative(scaled=False).eval())
    assert report.ok, report.to_text(color=False)
    assert any("T5's convention" in n for n in report.notes), report.notes


class _Absolute(nn.Module):
    """A learned bias for each (query, key) position pair: no relative bias."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.pair_bias = nn.Parameter(torch.randn(heads, 64, 64))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / (d // self.h) ** 0.5 + self.pair_bias[:, :n, :n]
        ctx = s.softmax(-1) @ v
        return self.out(ctx.transpose(1, 2).reshape(b, n, d))


def test_a_learned_bias_of_absolute_positions_is_refused_naming_it():
    with pytest.raises(
        AttnScopeError, match="not supported yet: a learned position bias that is not relative"
    ):
        check(lambda: _Absolute().eval())


def test_relative_table_reads_a_toeplitz_bias_per_head_and_nothing_else():
    layer = _Relative(heads=2)
    bias = layer.bias(5).detach()  # (2, 5, 5)
    table = relative_table(bias[None], (3, 2, 5, 5), 2)
    assert table is not None and torch.equal(table, bias.double())
    # a table that is not constant along its diagonals: none
    assert relative_table(torch.randn(1, 2, 5, 5), (3, 2, 5, 5), 2) is None
    # one that differs between the sequences of the batch: made from the input, none
    two = torch.stack([bias, bias + 1.0])
    assert relative_table(two, (2, 2, 5, 5), 2) is None


def test_hugging_face_t5_attention_with_its_bucketed_bias_passes_unscaled_said():
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    def make():
        torch.manual_seed(0)
        cfg = transformers.T5Config(d_model=64, d_kv=16, num_heads=4)
        return T5Attention(cfg, has_relative_attention_bias=True).eval()

    report = check(make)
    assert report.ok, report.to_text(color=False)
    assert report.structure["bias"] == "learned" and report.structure["heads"] == 4
    assert any("T5's convention" in n for n in report.notes), report.notes


class _CogViewSoftmax(_Relative):
    """The learned bias added, then CogView's stabilised softmax (``softmax((x / a -
    max(x / a)) * a)``, LayoutLMv3's): the factors cancel, the bias is not scaled after."""

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / (d // self.h) ** 0.5 + self.bias(n)
        s = s / 32.0
        w = ((s - s.amax(-1, keepdim=True)) * 32.0).softmax(-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, n, d))


def test_a_scale_and_its_inverse_after_the_bias_are_no_scale_after_it():
    report = check(lambda: _CogViewSoftmax().eval())
    assert report.ok, report.to_text(color=False)


# ---------------------------------------------------------------- rounds 38 and m31's first runs


class _LocalWhere(nn.Module):
    """Causal attention whose queries see their last ``window`` keys, hidden with
    ``torch.where(hide, number, scores)`` (Lingvo's ``GetDtypeMin`` fill: a number where
    the hidden scores go, the scores third)."""

    def __init__(self, window=4):
        super().__init__()
        torch.manual_seed(1)
        self.window = window
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n)
        gap = pos[:, None] - pos[None, :]
        hide = (gap < 0) | (gap >= self.window)
        s = torch.where(hide, -0.7 * torch.finfo(x.dtype).max, q @ k.mT * 8**-0.5)
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


def test_a_window_hidden_by_where_with_a_number_as_the_fill_is_read_as_a_window():
    report = check(lambda: _LocalWhere().eval(), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["window"] == 4


class _FlippedMemory(nn.Module):
    """Cross-attention that reverses its memory over the batch inside the layer
    (``memory.flip(0)``: each sequence's queries read another's memory) where ``flip``,
    after a LayerNorm of the memory either way."""

    def __init__(self, flip=False):
        super().__init__()
        torch.manual_seed(2)
        self.flip = flip
        self.norm = nn.LayerNorm(32)
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x, memory):
        b, n, _ = x.shape
        memory = self.norm(memory)
        if self.flip:
            memory = memory.flip(0)
        m = memory.shape[1]
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k = self.k(memory).view(b, m, 4, 8).transpose(1, 2)
        v = self.v(memory).view(b, m, 4, 8).transpose(1, 2)
        w = (q @ k.mT * 8**-0.5).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, 32))


def test_a_cross_layer_reading_another_sequences_memory_is_batch_mixing():
    assert check(lambda: _FlippedMemory().eval(), kind="cross").ok
    report = check(lambda: _FlippedMemory(flip=True).eval(), kind="cross")
    assert outcome(report) == ("scores", "batch_mixing"), report.to_text(color=False)


# ------------------------------------------------- a learned bias the model hands every layer


class _BiasedBlock(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.norm = nn.LayerNorm(32)
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x, position_bias):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        s = q @ k.mT * self.scale + position_bias
        return x + self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


class _HandsItsBias(nn.Module):
    """Token ids in; a relative bias made once by the model (``kind``: "learned", from an
    ``nn.Embedding`` of clipped offsets; "fixed": minus the square root of the distance, no
    parameter) handed to every layer; ``slip`` gives layer 1 the scale ``1 / d``."""

    def __init__(self, kind="learned", slip=False):
        super().__init__()
        torch.manual_seed(3)
        self.kind = kind
        self.embed = nn.Embedding(50, 32)
        self.table = nn.Embedding(9, 4)
        self.layers = nn.ModuleList(
            [_BiasedBlock(8**-0.5), _BiasedBlock(1 / 8 if slip else 8**-0.5)]
        )
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        n = ids.shape[1]
        pos = torch.arange(n)
        offset = pos[None, :] - pos[:, None]
        if self.kind == "learned":
            bias = self.table(offset.clamp(-4, 4) + 4).permute(2, 0, 1)[None]
        else:
            bias = -offset.abs().double().sqrt()[None, None].expand(1, 4, n, n)
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, bias.to(h.dtype))
        return self.head(h)


def test_a_learned_bias_the_model_hands_every_layer_is_learned_in_each():
    report = check(lambda: _HandsItsBias().eval())
    assert report.ok, report.to_text(color=False)
    assert [r.structure["bias"] for _, r in report.layers] == ["learned", "learned"]
    slipped = check(lambda: _HandsItsBias(slip=True).eval())
    assert slipped.first_layer == "layers.1", slipped.to_text(color=False)
    assert slipped.first_failure.stage == "scaled_scores"
    assert slipped.first_failure.mistake == "wrong_scale"


def test_a_fixed_bias_the_model_hands_that_is_not_alibi_stays_refused():
    with pytest.raises(AttnScopeError, match="not ALiBi's"):
        check(lambda: _HandsItsBias(kind="fixed").eval())


@pytest.mark.parametrize("name", ["t5", "mpnet"])
def test_hugging_face_models_that_hand_their_relative_bias_to_every_layer(name):
    transformers = pytest.importorskip("transformers")

    def make():
        torch.manual_seed(0)
        if name == "t5":
            cfg = transformers.T5Config(
                vocab_size=96, d_model=64, d_kv=16, num_heads=4, num_layers=2, d_ff=128
            )
            return transformers.T5EncoderModel(cfg).eval()
        cfg = transformers.MPNetConfig(
            vocab_size=96,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
        )
        return transformers.MPNetModel(cfg).eval()

    report = check(make)
    assert report.ok, report.to_text(color=False)
    assert all(r.structure["bias"] == "learned" for _, r in report.layers)


# ---------------------------------------------------------------- round 39's first run


class _Relaxed(nn.Module):
    """PB-Relax as BEiT-3 and BEATs write it: the queries scaled by ``1 / alpha`` on top of
    ``1 / sqrt(d)``, the scores' row maximum taken off and the scores multiplied by ``alpha``
    again before the softmax: the scale is ``1 / sqrt(d)``, no multiplier of the weights."""

    def __init__(self, alpha=32.0):
        super().__init__()
        torch.manual_seed(4)
        self.alpha = alpha
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        q = q * 8**-0.5 * (1 / self.alpha)
        s = q @ k.mT
        s = (s - s.amax(-1, keepdim=True)) * self.alpha
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


def test_a_factor_on_the_queries_undone_on_the_scores_is_no_multiplier():
    report = check(lambda: _Relaxed().eval())
    assert report.ok, report.to_text(color=False)
    assert not any("muP" in n for n in report.notes), report.notes


class _TableNeverAdded(_Relative):
    """Holds its learned relative bias table and never adds it (a guard inverted)."""

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-1, -2) / (d // self.h) ** 0.5).softmax(-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, n, d))


def test_a_learned_bias_table_held_and_never_added_is_bias_missing():
    report = check(lambda: _TableNeverAdded().eval())
    assert outcome(report) == ("biased_scores", "bias_missing"), report.to_text(color=False)


class _TopK(nn.Module):
    """Cross-attention over the ``keep`` keys most relevant to the queries on average
    (FlashVDM's key selection): sparse attention, not modelled."""

    def __init__(self, keep=4):
        super().__init__()
        torch.manual_seed(5)
        self.keep = keep
        self.q, self.kv, self.o = nn.Linear(32, 32), nn.Linear(32, 64), nn.Linear(32, 32)

    def forward(self, x, context):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = self.kv(context).view(b, -1, 4, 16).transpose(1, 2).split(8, -1)
        top = (q @ k.mT).mean(-2).topk(min(self.keep, k.shape[-2]), dim=-1).indices
        index = top[..., None].expand(-1, -1, -1, 8)
        k, v = k.gather(-2, index), v.gather(-2, index)
        w = (q @ k.mT * 8**-0.5).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, 32))


def test_keys_selected_by_top_k_are_refused_naming_it():
    with pytest.raises(AttnScopeError, match="not supported yet: a selection by topk"):
        check(lambda: _TopK().eval(), kind="cross")


class _Diffusion(nn.Module):
    """A causal layer whose configuration's ``block_size`` (4) is a diffusion block, not
    its context: it takes any length."""

    block_size = 4

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, 32))


def test_a_declared_size_shorter_than_the_probe_binds_only_where_longer_input_fails():
    report = check(lambda: _Diffusion().eval())
    assert report.ok, report.to_text(color=False)
    assert report.checks[0].predicted[-2] >= 7  # probed at the usual length, not 3 tokens


class _Cross(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(32, 32), nn.Linear(32, 64), nn.Linear(32, 32)

    def forward(self, x, context=None):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = self.kv(context).view(b, -1, 4, 16).transpose(1, 2).split(8, -1)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, n, 32))


class _TwoAttentions(nn.Module):
    """A block of self-attention, then cross-attention over ``encoder_hidden_states``
    (optional; the cross layer raises without it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.attn1 = nn.MultiheadAttention(32, 4, batch_first=True)
        self.attn2 = _Cross()

    def forward(self, hidden_states, encoder_hidden_states=None):
        h = self.norm1(hidden_states)
        hidden_states = hidden_states + self.attn1(h, h, h, need_weights=False)[0]
        return hidden_states + self.attn2(self.norm2(hidden_states), encoder_hidden_states)


def test_a_block_whose_cross_layer_needs_its_optional_sequence_is_checked_layer_by_layer():
    report = check(lambda: _TwoAttentions().eval())
    assert report.ok, report.to_text(color=False)
    assert len(report.layers) == 2


class _TimeMajor(nn.Module):
    """fairseq's time-major layer, ``(tokens, batch, d)`` in; ``slip``: the keys viewed
    straight as ``(batch * heads, tokens, head_dim)`` with no transpose."""

    def __init__(self, slip=False):
        super().__init__()
        torch.manual_seed(8)
        self.slip = slip
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        t, b, _ = x.size()
        q = self.q(x).contiguous().view(t, b * 4, 8).transpose(0, 1) * 8**-0.5
        k = self.k(x).contiguous()
        k = k.view(b * 4, t, 8) if self.slip else k.view(t, b * 4, 8).transpose(0, 1)
        v = self.v(x).contiguous().view(t, b * 4, 8).transpose(0, 1)
        w = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        return self.o(torch.bmm(w, v).transpose(0, 1).contiguous().view(t, b, 32))


def test_time_major_keys_viewed_with_no_transpose_are_heads_split():
    assert check(lambda: _TimeMajor().eval()).ok
    report = check(lambda: _TimeMajor(slip=True).eval())
    assert outcome(report) == ("keys", "heads_split"), report.to_text(color=False)


# ---------------------------------------------------------------- m32 and round 40's first runs


class _NeuralEngine(nn.Module):
    """One attention layer in Apple's Neural Engine layout: hidden states ``(b, d, 1, n)``,
    1x1 ``Conv2d`` projections, scores laid out keys first ``(b, keys, 1, queries)`` with the
    softmax over axis 1, an additive mask of ``-1e4`` that hides the future and, with
    ``window``, keys more than ``window - 1`` back."""

    def __init__(self, window=None):
        super().__init__()
        self.window = window
        self.q, self.k, self.v, self.o = (nn.Conv2d(32, 32, 1) for _ in range(4))

    def forward(self, x):
        n = x.shape[-1]
        q, k, v = self.q(x), self.k(x), self.v(x)
        pos = torch.arange(n)
        seen = pos[:, None] <= pos[None, :]  # (keys, queries)
        if self.window is not None:
            seen = seen & (pos[:, None] > pos[None, :] - self.window)
        mask = torch.zeros(n, n, dtype=x.dtype).masked_fill(~seen, -1e4)[None, :, None, :]
        outs = []
        for h in range(4):
            qh, kh, vh = (t[:, 8 * h : 8 * h + 8] for t in (q, k, v))
            w = torch.einsum("bchq,bkhc->bkhq", qh, kh.transpose(1, 3)) * 8**-0.5
            w = (w + mask).softmax(dim=1)
            outs.append(torch.einsum("bkhq,bchk->bchq", w, vh))
        return self.o(torch.cat(outs, dim=1))


class _EngineModel(nn.Module):
    def __init__(self, window=None):
        super().__init__()
        torch.manual_seed(9)
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList([_NeuralEngine(window), _NeuralEngine(window)])
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        x = self.embed(ids).transpose(1, 2).unsqueeze(2)  # (b, d, 1, n)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x.squeeze(2).transpose(1, 2))


@pytest.mark.parametrize("window", [None, 3])
def test_a_model_in_the_neural_engine_layout_is_checked_with_its_mask(window):
    report = check(lambda: _EngineModel(window).eval())
    assert report.ok, report.to_text(color=False)
    assert [r.structure["window"] for _, r in report.layers] == [window, window]
    assert all(r.kind == "causal-multihead" for _, r in report.layers)


class _DropsItsBias(_BiasedBlock):
    """The block's fused path: SDPA called with no mask, the bias it is handed dropped."""

    def forward(self, x, position_bias):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(y.transpose(1, 2).reshape(b, n, 32))


class _HandsBiasItDrops(nn.Module):
    """One block handed the wrapper's learned relative bias, which it drops."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(10)
        self.table = nn.Embedding(9, 4)
        self.block = _DropsItsBias(8**-0.5)

    def forward(self, x):
        pos = torch.arange(x.shape[1])
        offset = (pos[None, :] - pos[:, None]).clamp(-4, 4) + 4
        return self.block(x, self.table(offset).permute(2, 0, 1)[None])


def test_a_learned_bias_a_wrapper_makes_and_its_layer_drops_is_bias_missing():
    report = check(lambda: _HandsBiasItDrops().eval())
    assert outcome(report) == ("biased_scores", "bias_missing"), report.to_text(color=False)


def test_a_learned_bias_a_model_hands_and_its_second_layer_drops_is_bias_missing_there():
    def make():
        model = _HandsItsBias()
        model.layers[1] = _DropsItsBias(8**-0.5)
        return model.eval()

    report = check(make)
    assert report.first_layer == "layers.1", report.to_text(color=False)
    assert report.first_failure.mistake == "bias_missing"
