"""Attention computed in styles that hide its tensors: one head's function vmapped over the
heads (``torch.func.vmap``), keys split in two and the halves merged by their log-sum-exps
(flash-decoding), and scores written keys times queries in a grouped layer."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn
from torch.func import vmap

from attnscope import check


def _one_head(q, k, v, scale, keys_first=False):
    """One head: q ``(t, d)``, k and v ``(s, d)``; causal."""
    s = (k @ q.T) if keys_first else (q @ k.T)
    s = s * scale
    t, n = s.shape
    s = s.masked_fill(torch.ones(t, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


class _VmappedGrouped(nn.Module):
    """4 query heads over 2 kv heads, with no repeat_kv: one head's function vmapped over
    the heads of a group (the kv head broadcast), the groups and the batch."""

    def __init__(self, keys_first=False, d=32, h=4, kv=2):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.kv, self.hd = h, kv, d // h
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv * self.hd, bias=False)
        self.v = nn.Linear(d, kv * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        per_head = vmap(
            lambda q, k, v: _one_head(q, k, v, 1 / math.sqrt(self.hd), keys_first),
            in_dims=(0, None, None),
        )
        self.attend = vmap(vmap(per_head))  # over the kv groups, then over the batch

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.kv, self.h // self.kv, self.hd).permute(0, 2, 3, 1, 4)
        k = self.k(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        ctx = self.attend(q, k, v)  # (b, kv, group, n, hd)
        return self.o(ctx.reshape(b, self.h, n, self.hd).transpose(1, 2).reshape(b, n, -1))


def test_attention_vmapped_over_heads_is_read_as_grouped_attention():
    """vmap's batched tensors vanish when it returns: the record runs it as its loop, and
    sees every head's scores (it had found no attention)."""
    report = check(lambda: _VmappedGrouped(), kind="causal-multihead")
    assert outcome(report) == ("ok",), report.to_text(color=False)
    assert (report.structure["heads"], report.structure["kv_heads"]) == (4, 2)


def test_vmap_still_works_after_the_check():
    """The loop stands in for vmap only while a record runs."""
    check(lambda: _VmappedGrouped(), kind="causal-multihead")
    from torch._functorch import apis

    assert apis.vmap_impl.__module__ == "torch._functorch.vmap"
    x = torch.randn(3, 5)
    assert torch.equal(vmap(torch.sin)(x), torch.sin(x))


def test_keys_times_queries_in_a_grouped_layer_is_scores_transposed():
    """The first operand made by the narrower projection, as wide as the values, is the
    keys: read from the widths, not the names (it had been refused as a rotation)."""
    report = check(lambda: _VmappedGrouped(keys_first=True), kind="causal-multihead")
    assert outcome(report) == ("scores", "scores_transposed"), report.to_text(color=False)


class _SplitKeys(nn.Module):
    """Keys and values cut in two; each half's attention and log-sum-exp computed apart, then
    merged by ``exp(lse_i - logsumexp(lse))`` (exact), or by the halves' maxima (a slip).
    QK norms over the whole projections; grouped heads repeated before the split (tiled by
    ``repeat`` where ``tiled``)."""

    def __init__(self, merge="lse", tiled=False, d=32, h=4, kv=2):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.kv, self.hd, self.merge, self.tiled = h, kv, d // h, merge, tiled
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv * self.hd, bias=False)
        self.v = nn.Linear(d, kv * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=1e-6)
        self.k_norm = nn.RMSNorm(kv * self.hd, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        b, n, _ = x.shape
        g = self.h // self.kv
        q = self.q_norm(self.q(x)).view(b, n, self.h, self.hd).transpose(1, 2)
        k = self.k_norm(self.k(x)).view(b, n, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        if self.tiled:
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        cut = (n + 1) // 2
        outs, lses = [], []
        for lo, hi in ((0, cut), (cut, n)):
            s = q @ k[:, :, lo:hi].transpose(-1, -2) / math.sqrt(self.hd)
            rows = torch.arange(n)[:, None]
            s = s.masked_fill(torch.arange(lo, hi)[None, :] > rows, torch.finfo(s.dtype).min)
            lse = torch.logsumexp(s, -1, keepdim=True)
            outs.append(torch.exp(s - lse) @ v[:, :, lo:hi])
            lses.append(lse)
        lse = torch.stack(lses)
        total = lse.amax(0) if self.merge == "max" else torch.logsumexp(lse, 0)
        ctx = sum(torch.exp(l_i - total) * o for l_i, o in zip(lses, outs, strict=True))
        return self.o(ctx.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("tiled", [False, True], ids=["interleaved", "tiled"])
def test_split_keys_merged_by_log_sum_exp_are_attention(tiled):
    """The merge's factors are made from the scores alone: softmax bookkeeping, not an
    output gate (it had been refused as one). Interleaved repeats pass; tiled ones are the
    grouped heads' mapping slip, read through a norm over the whole key projection."""
    report = check(lambda: _SplitKeys(tiled=tiled), kind="causal-multihead")
    want = ("scores", "kv_group_mapping") if tiled else ("ok",)
    assert outcome(report) == want, report.to_text(color=False)


def test_split_keys_merged_by_their_maxima_fail():
    report = check(lambda: _SplitKeys(merge="max"), kind="causal-multihead")
    assert not report.ok


def test_a_record_inside_another_keeps_vmap_a_loop_and_restores_it():
    """Nested records: the inner one leaves the outer's loop in place (no recursion into
    itself), and torch's own batching is back once the outer one ends."""
    from torch._functorch import apis

    from attnscope.checking.record import Recorder

    original = apis.vmap_impl
    x = torch.randn(3, 4)
    with Recorder(), Recorder():
        assert torch.allclose(vmap(torch.sin)(x), torch.sin(x))
    assert apis.vmap_impl is original
