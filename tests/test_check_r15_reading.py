"""Readings that round 15's first run asked for: queries processed in chunks (exact
attention, not a product over the tokens that drops them), and a decoder block whose first
layer is self-attention checked as --kind cross."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import outcome
from torch import nn

from attnscope import AttnScopeError, check


class _ChunkedQueries(nn.Module):
    """Memory-efficient attention (Rabe & Staats): queries ``chunk`` at a time against every
    key, the chunks' contexts joined; exact."""

    def __init__(self, chunk=4, d=32, h=4):
        super().__init__()
        torch.manual_seed(0)
        self.chunk, self.h, self.dk = chunk, h, d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            p(x).view(b, n, self.h, self.dk).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        out = []
        for start in range(0, n, self.chunk):
            w = (q[:, :, start : start + self.chunk] @ k.transpose(-1, -2)) / math.sqrt(self.dk)
            out.append(w.softmax(-1) @ v)
        return self.o(torch.cat(out, 2).transpose(1, 2).reshape(b, n, d))


def test_queries_processed_in_chunks_are_exact_attention():
    """A chunk's weights times the values keeps no whole tokens axis, yet is no k'^T v (it
    had been refused as linear attention)."""
    report = check(lambda: _ChunkedQueries(), kind="multihead")
    assert outcome(report) == ("ok",), report.to_text(color=False)


class _Attention(nn.Module):
    def __init__(self, d=32, h=4, causal=False):
        super().__init__()
        self.h, self.dk, self.causal = h, d // h, causal
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, context=None):
        src = x if context is None else context
        b, n, d = x.shape
        m = src.shape[1]
        q = self.q(x).view(b, n, self.h, self.dk).transpose(1, 2)
        k, v = (p(src).view(b, m, self.h, self.dk).transpose(1, 2) for p in (self.k, self.v))
        s = q @ k.transpose(-1, -2) / math.sqrt(self.dk)
        if self.causal:
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _DecoderBlock(nn.Module):
    """Self-attention, then cross-attention when an encoder output is handed in."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.self_attn, self.encoder_attn = _Attention(causal=True), _Attention()

    def forward(self, x, encoder_hidden_states=None):
        x = x + self.self_attn(x)
        if encoder_hidden_states is not None:
            x = x + self.encoder_attn(x, encoder_hidden_states)
        return x


def test_kind_cross_on_a_block_whose_first_layer_is_self_attention_checks_both_layers():
    """It had judged the self-attention layer as a cross layer reading the wrong source (a
    false alarm), then refused naming the cross layer; now the block is checked as the two
    layers it runs when handed encoder states, each with its own kind."""
    report = check(lambda: _DecoderBlock(), kind="cross")
    assert report.ok, report.to_text(color=False)
    assert [(p, r.kind) for p, r in report.layers] == [
        ("self_attn", "causal-multihead"),
        ("encoder_attn", "cross"),
    ]


class _PrefixLM(nn.Module):
    """PaliGemma's prefix-LM mask: the first ``prefix`` tokens see each other, the rest are
    causal (``prefix=None``: no mask at all, a decoder that forgot its own)."""

    def __init__(self, prefix=8, d=32, h=4):
        super().__init__()
        torch.manual_seed(0)
        self.prefix, self.h, self.dk = prefix, h, d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            p(x).view(b, n, self.h, self.dk).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        s = q @ k.transpose(-1, -2) / math.sqrt(self.dk)
        if self.prefix is not None:
            pos = torch.arange(n)
            hidden = (pos[None, :] > pos[:, None]) & (pos[None, :] >= self.prefix)
            s = s.masked_fill(hidden, float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


def test_a_layer_given_as_causal_is_read_on_a_longer_call_where_it_shows_no_mask():
    """A prefix-LM mask hides nothing at 7 tokens; given as causal, the layer is read again
    on a longer call, where the prefix shows: refused (it had been judged missing_mask). A
    layer with no mask at any length keeps its verdict."""
    with pytest.raises(AttnScopeError, match="mask of another pattern"):
        check(lambda: _PrefixLM(8), kind="causal-multihead")
    report = check(lambda: _PrefixLM(None), kind="causal-multihead")
    assert outcome(report) == ("masked_scores", "missing_mask"), report.to_text(color=False)
