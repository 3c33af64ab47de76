"""attnscope check on what round 10 found passed as correct or given a verdict it could not
give: a weight handed twice to ``F.multi_head_attention_forward`` (keys made with the
queries' weight while the keys' own sits idle), ALiBi slopes a layer holds and never adds, a
sliding window declared in a ``model_args`` dataclass (torchtitan's), and two operations the
reference does not model (score maps mixed across heads; weights combined from two softmax
maps), refused instead of judged."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnscope import AttnScopeError, check
from attnscope.functional import alibi_slopes


def _outcome(report):
    if report.ok:
        return ("ok",)
    return (report.first_failure.stage.value, report.first_failure.mistake)


# ------------------------------------------------------------ F.multi_head_attention_forward


class _FunctionalMHA(nn.Module):
    def __init__(self, d=32, heads=4, k_from_q=False):
        super().__init__()
        torch.manual_seed(0)
        self.d, self.heads, self.k_from_q = d, heads, k_from_q
        self.q_proj_weight = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
        self.k_proj_weight = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
        self.v_proj_weight = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
        self.in_proj_bias = nn.Parameter(torch.randn(3 * d) * 0.1)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x):  # (B, T, d)
        h = x.transpose(0, 1)
        out, _ = F.multi_head_attention_forward(
            h,
            h,
            h,
            self.d,
            self.heads,
            None,
            self.in_proj_bias,
            None,
            None,
            False,
            0.0,
            self.out_proj.weight,
            self.out_proj.bias,
            training=False,
            need_weights=False,
            use_separate_proj_weight=True,
            q_proj_weight=self.q_proj_weight,
            k_proj_weight=self.q_proj_weight if self.k_from_q else self.k_proj_weight,
            v_proj_weight=self.v_proj_weight,
        )
        return out.transpose(0, 1)


def test_functional_mha_with_separate_weights_passes():
    report = check(lambda: _FunctionalMHA(), kind="multihead")
    assert report.ok, report.to_text(color=False)


def test_functional_mha_keys_made_with_the_query_weight_is_wrong_projection():
    report = check(lambda: _FunctionalMHA(k_from_q=True), kind="multihead")
    assert _outcome(report) == ("keys", "wrong_projection"), report.to_text(color=False)


class _MHABlock(nn.Module):
    """nn.MultiheadAttention (one packed in_proj_weight) in a block that holds a linear of
    the same shape it does not use here."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.spare = nn.Linear(32, 32)

    def forward(self, x):
        return x + self.attn(x, x, x, need_weights=False)[0]


def test_torch_multihead_attention_still_passes():
    def make():
        torch.manual_seed(0)
        return nn.MultiheadAttention(32, 4, batch_first=True)

    assert check(make, kind="multihead").ok
    report = check(lambda: _MHABlock(), kind="multihead")
    assert report.ok, report.to_text(color=False)


# ------------------------------------------------------------ ALiBi slopes held, never added


class _HeldAlibi(nn.Module):
    """Causal attention holding ALiBi slopes; ``add`` says whether the bias reaches the
    scores (a flex-attention score_mod passed, or built and left out)."""

    def __init__(self, d=32, heads=4, add=True):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.dk, self.add = heads, d // heads, add
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("slopes", alibi_slopes(heads).float())

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.h, self.dk).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        s = q @ k.transpose(-1, -2) / math.sqrt(self.dk)
        pos = torch.arange(t)
        bias = self.slopes.to(x.dtype)[:, None, None] * (pos[None, :] - pos[:, None])
        if self.add:
            s = s + bias
        s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        out = s.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


def test_held_alibi_slopes_added_pass():
    report = check(lambda: _HeldAlibi(), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)


def test_held_alibi_slopes_never_added_is_bias_missing():
    report = check(lambda: _HeldAlibi(add=False), kind="causal-multihead")
    assert _outcome(report) == ("biased_scores", "bias_missing"), report.to_text(color=False)


# ------------------------------------------------------------ a window in model_args


@dataclass
class _Args:
    dim: int = 32
    n_heads: int = 4
    max_seq_len: int = 64
    sliding_window: int = 4


class _WindowAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.h, self.dk = args.n_heads, args.dim // args.n_heads
        self.wq, self.wk, self.wv, self.wo = (
            nn.Linear(args.dim, args.dim, bias=False) for _ in range(4)
        )

    def forward(self, x, keep):
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, self.h, self.dk).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class _WindowModel(nn.Module):
    """torchtitan's layout: the configuration a ``model_args`` dataclass on the model, the
    window's mask built by the model and handed to the layer."""

    def __init__(self, mistake=None):
        super().__init__()
        torch.manual_seed(0)
        self.model_args = _Args()
        self.mistake = mistake
        self.layers = nn.ModuleDict({"0": _WindowAttention(self.model_args)})

    def forward(self, x):
        t = x.shape[1]
        q_idx, kv_idx = torch.arange(t)[:, None], torch.arange(t)[None, :]
        w = self.model_args.max_seq_len if self.mistake == "max" else self.model_args.sliding_window
        near = q_idx - kv_idx <= w if self.mistake == "le" else q_idx - kv_idx < w
        keep = (q_idx >= kv_idx) & near
        for layer in self.layers.values():
            x = x + layer(x, keep)
        return x


@pytest.mark.parametrize(
    "mistake, want",
    [
        (None, ("ok",)),
        ("le", ("masked_scores", "window_size")),
        ("max", ("masked_scores", "window_missing")),
    ],
)
def test_window_declared_in_model_args_is_held_to(mistake, want):
    report = check(lambda: _WindowModel(mistake), kind="causal-multihead")
    assert _outcome(report) == want, report.to_text(color=False)


# ------------------------------------------------------------ refused: not in the reference


class _Attention(nn.Module):
    """Plain multi-head attention whose scores or weights ``variant`` changes."""

    def __init__(self, d=32, heads=4, variant=None):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.dk, self.variant = heads, d // heads, variant
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mix = nn.Parameter(torch.eye(heads) + 0.3 * torch.randn(heads, heads))
        self.lam = nn.Parameter(torch.tensor(0.4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.h, self.dk).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        s = q @ k.transpose(-1, -2) / math.sqrt(self.dk)
        if self.variant == "talking":  # the score maps mixed across heads
            s = torch.einsum("bhij,hg->bgij", s, self.mix)
        w = s.softmax(-1)
        if self.variant == "diff":  # one softmax map minus a multiple of another's
            shifted = (s * 0.5).softmax(-1)
            w = w - self.lam * shifted
        if self.variant == "transposed":  # a genuine mistake: weights^T @ values
            w = w.transpose(-1, -2)
        out = w @ v
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


def test_scores_mixed_across_heads_are_refused_naming_heads():
    with pytest.raises(AttnScopeError, match="not supported yet: the scores mixed across heads"):
        check(lambda: _Attention(variant="talking"), kind="multihead")


def test_weights_from_two_softmaxes_are_refused_naming_the_softmax():
    with pytest.raises(AttnScopeError, match="not supported yet: .*two softmax maps"):
        check(lambda: _Attention(variant="diff"), kind="multihead")


def test_plain_and_genuinely_wrong_products_keep_their_verdicts():
    assert check(lambda: _Attention(), kind="multihead").ok
    report = check(lambda: _Attention(variant="transposed"), kind="multihead")
    assert _outcome(report) == ("context", "context_wrong_product"), report.to_text(color=False)


def test_held_alibi_slopes_switched_off_by_a_flag_pass():
    def make():
        layer = _HeldAlibi(add=False)
        layer.alibi = False  # declared, and off: the slopes sit idle by design
        return layer

    report = check(make, kind="causal-multihead")
    assert report.ok, report.to_text(color=False)


# ------------------------------------------------------------ a causal mask built and dropped


class _MaskedLayer(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.h, self.dk).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class _MaskingModel(nn.Module):
    """A body that builds its causal mask and hands it on (``drop``: builds it and hands
    None, as a path that leaves causality to a kernel flag nobody sets)."""

    def __init__(self, drop=False, flag=None):
        super().__init__()
        torch.manual_seed(0)
        self.drop = drop
        if flag is not None:
            self.is_causal = flag
        self.layer = _MaskedLayer()

    def forward(self, x):
        pos = torch.arange(x.shape[1])
        mask = pos[None, :] <= pos[:, None]
        if self.drop:
            mask = None
        return x + self.layer(x, mask)


def test_a_causal_mask_handed_on_is_read_as_causal():
    report = check(lambda: _MaskingModel())
    assert report.kind == "causal-multihead", report.kind_reason
    assert report.ok, report.to_text(color=False)


def test_a_causal_mask_built_and_dropped_makes_a_decoder_missing_its_mask():
    report = check(lambda: _MaskingModel(drop=True))  # the kind inferred
    assert report.kind == "causal-multihead", report.kind_reason
    assert _outcome(report) == ("masked_scores", "missing_mask"), report.to_text(color=False)


class _NumpyMaskModel(nn.Module):
    """A block that builds its causal mask with numpy (never a torch call the record sees)
    and calls the layer without it (round 11, b08)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = _MaskedLayer()

    def forward(self, x):
        n = x.shape[1]
        causal = torch.from_numpy(np.tril(np.ones((1, 1, n, n), dtype=bool)))  # noqa: F841
        return x + self.layer(x, None)


def test_a_causal_mask_built_outside_torch_and_dropped_makes_a_decoder():
    report = check(lambda: _NumpyMaskModel())  # the kind inferred
    assert report.kind == "causal-multihead", report.kind_reason
    assert "causal mask" in report.kind_reason
    assert _outcome(report) == ("masked_scores", "missing_mask"), report.to_text(color=False)


def test_a_dropped_mask_in_a_model_declared_not_causal_passes_as_an_encoder():
    report = check(lambda: _MaskingModel(drop=True, flag=False))
    assert report.kind == "multihead", report.kind_reason
    assert report.ok, report.to_text(color=False)
