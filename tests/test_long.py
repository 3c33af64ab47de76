"""Long sequences: the blocked core, per-query summaries and row traces.

The blocked core (online softmax over key blocks) must equal ``attend`` and torch's
``scaled_dot_product_attention`` for every shape, kind and block size, including blocks
that do not divide the tokens; the summaries must equal the same quantities read from a full
softmax; a row trace must equal the same rows of a full trace.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnscope
import attnscope.functional as AF
from attnscope import GroupedQueryAttention
from attnscope.stages import MATRIX_STAGES

FAST = settings(max_examples=30, deadline=None)
SUMMARY_FIELDS = ("entropy", "max_weight", "top_weights", "sink_weight", "mean_distance")


def _tensors(seed, batch, heads, kv_heads, tokens, d, d_v):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, d, generator=g)
    k = torch.randn(batch, kv_heads, tokens, d, generator=g)
    v = torch.randn(batch, kv_heads, tokens, d_v, generator=g)
    return q, k, v


def _reference(q, k, v, causal, window, slopes):
    """The full-matrix path: attend's record (weights) and context."""
    tokens = q.shape[-2]
    bias = None if slopes is None else AF.alibi_bias(slopes, tokens).to(q.dtype)
    record: dict = {}
    context = AF.attend(q, k, v, causal=causal, window=window, bias=bias, record=record)
    return context, record


cases = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "batch": st.integers(1, 2),
        "kv_heads": st.sampled_from([1, 2]),
        "group": st.sampled_from([1, 2, 3]),
        "tokens": st.integers(1, 40),
        "d": st.sampled_from([1, 4, 8]),
        "d_v": st.sampled_from([2, 5]),
        "kind": st.sampled_from(["full", "causal", "window", "alibi", "alibi-window", "alibi-all"]),
        "window": st.integers(1, 9),
        "block": st.integers(1, 48),
    }
)


def _unpack(c):
    heads = c["kv_heads"] * c["group"]
    q, k, v = _tensors(c["seed"], c["batch"], heads, c["kv_heads"], c["tokens"], c["d"], c["d_v"])
    kind = c["kind"]
    causal = kind in ("causal", "window", "alibi", "alibi-window")
    window = c["window"] if kind in ("window", "alibi-window") else None
    slopes = AF.alibi_slopes(heads).float() if kind.startswith("alibi") else None
    return q, k, v, causal, window, slopes


@FAST
@given(cases)
def test_blocked_equals_attend_and_sdpa(c):
    q, k, v, causal, window, slopes = _unpack(c)
    out = AF.blocked_attention(
        q, k, v, causal=causal, window=window, bias_slopes=slopes, block=c["block"]
    )
    context, _ = _reference(q, k, v, causal, window, slopes)
    torch.testing.assert_close(out, context, atol=2e-5, rtol=1e-4)
    # torch's own: the grouped heads repeated, the mask and bias as one additive mask
    group = q.shape[1] // k.shape[1]
    kr, vr = AF.repeat_kv(k, group), AF.repeat_kv(v, group)
    tokens = q.shape[-2]
    mask = torch.zeros(tokens, tokens)
    if causal:
        hide = AF.causal_mask(tokens) if window is None else AF.sliding_window_mask(tokens, window)
        mask = mask.masked_fill(hide, -torch.inf)
    if slopes is not None:
        mask = mask + AF.alibi_bias(slopes, tokens).float()
    sdpa = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    torch.testing.assert_close(out, sdpa, atol=2e-5, rtol=1e-4)


@FAST
@given(cases, st.data())
def test_blocked_rows_are_the_same_rows(c, data):
    q, k, v, causal, window, slopes = _unpack(c)
    tokens = q.shape[-2]
    rows = data.draw(st.lists(st.integers(0, tokens - 1), min_size=1, max_size=4, unique=True))
    out = AF.blocked_attention(
        q, k, v, causal=causal, window=window, bias_slopes=slopes, block=c["block"], rows=rows
    )
    context, record = _reference(q, k, v, causal, window, slopes)
    torch.testing.assert_close(out, context[..., rows, :], atol=2e-5, rtol=1e-4)
    stages = AF.attend_rows(q, k, rows, causal=causal, window=window, bias_slopes=slopes)
    assert set(stages) == {s for s in record if s != "context"}
    for name, tensor in stages.items():
        torch.testing.assert_close(tensor, record[name][..., rows, :], atol=1e-5, rtol=1e-5)


@FAST
@given(cases, st.integers(1, 6))
def test_summary_equals_the_full_softmax(c, k):
    q, kk, v, causal, window, slopes = _unpack(c)
    context, s = AF.attention_summary(
        q, kk, v, causal=causal, window=window, bias_slopes=slopes, block=c["block"], k=k
    )
    ref_context, record = _reference(q, kk, v, causal, window, slopes)
    torch.testing.assert_close(context, ref_context, atol=2e-5, rtol=1e-4)
    want = AF.summarize_weights(record["weights"], k=k)
    for name in SUMMARY_FIELDS:
        torch.testing.assert_close(getattr(s, name), getattr(want, name), atol=1e-4, rtol=1e-4)
    w = record["weights"]
    # keys: the largest weight's key holds the largest weight (exact ties may differ)
    held = w.gather(-1, s.max_key.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(held, want.max_weight, atol=1e-6, rtol=1e-5)
    top = w.gather(-1, s.top_keys.clamp(min=0))
    torch.testing.assert_close(torch.where(s.top_keys >= 0, top, 0.0), want.top_weights)
    assert s.top_keys.shape == (*w.shape[:-1], k)


def test_summary_by_hand():
    """One query, three keys with known weights: every field from its definition."""
    q = torch.zeros(1, 1, 3, 1)
    k = torch.zeros(1, 1, 3, 1)
    v = torch.zeros(1, 1, 3, 1)
    # all scores equal: query 2 sees keys 0, 1, 2 equally
    _, s = AF.attention_summary(q, k, v, causal=True, block=2, k=4)
    third = torch.tensor(1 / 3)
    torch.testing.assert_close(s.entropy[0, 0, 2], torch.log(torch.tensor(3.0)))
    torch.testing.assert_close(s.max_weight[0, 0, 2], third)
    assert s.max_key[0, 0, 2] == 0  # the first of equal keys
    assert s.top_keys[0, 0, 2].tolist()[3] == -1  # only three keys to see
    torch.testing.assert_close(s.sink_weight[0, 0], torch.tensor([1.0, 0.5, 1 / 3]))
    torch.testing.assert_close(s.mean_distance[0, 0], torch.tensor([0.0, 0.5, 1.0]))
    assert s.entropy[0, 0, 0] == 0


def test_window_hides_the_sink():
    q, k, v = _tensors(0, 1, 2, 1, 12, 4, 3)
    _, s = AF.attention_summary(q, k, v, causal=True, window=4, block=5)
    assert (s.sink_weight[..., 4:] == 0).all() and (s.sink_weight[..., :4] > 0).all()
    assert (s.mean_distance <= 3 + 1e-5).all()


def test_blocked_errors():
    q, k, v = _tensors(0, 1, 4, 2, 6, 4, 4)
    with pytest.raises(attnscope.AttnScopeError, match="window"):
        AF.blocked_attention(q, k, v, window=3)
    with pytest.raises(attnscope.AttnScopeError, match="block"):
        AF.blocked_attention(q, k, v, block=0)
    with pytest.raises(attnscope.AttnScopeError, match="bias_slopes"):
        AF.blocked_attention(q, k, v, bias_slopes=torch.ones(3))
    with pytest.raises(attnscope.AttnScopeError, match="rows"):
        AF.blocked_attention(q, k, v, rows=[6])
    with pytest.raises(attnscope.AttnScopeError, match="distinct"):
        AF.blocked_attention(q, k, v, rows=[1, 1])
    with pytest.raises(attnscope.AttnScopeError, match="keys"):
        AF.blocked_attention(q, k[:, :, :, :3], v)


def test_blocked_never_holds_the_matrix():
    """Peak extra memory scales with block * tokens, not tokens squared: at 4,096 tokens
    a (T, T) float matrix alone is 64 MiB; the blocked pass stays far under it."""
    tokens = 4096
    q, k, v = _tensors(1, 1, 1, 1, tokens, 16, 16)
    rows = [0, tokens - 1]
    seen = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a, b):
        out = real_matmul(a, b)
        seen.append(out.numel())
        return out

    torch.Tensor.__matmul__ = spy
    try:
        out, s = AF.attention_summary(q, k, v, causal=True, block=256)
        AF.attend_rows(q, k, rows, causal=True)
    finally:
        torch.Tensor.__matmul__ = real_matmul
    assert max(seen) <= 256 * 256 or max(seen) <= len(rows) * tokens
    assert max(seen) < tokens * tokens // 100
    assert out.shape == (1, 1, tokens, 16) and s.entropy.shape == (1, 1, tokens)


# --- row traces ------------------------------------------------------------------------------


def _modules():
    torch.manual_seed(7)
    return {
        "v1": attnscope.SelfAttentionV1(8, 6),
        "v2": attnscope.SelfAttentionV2(8, 6),
        "causal": attnscope.CausalAttention(8, 6, 30, 0.0),
        "mha": attnscope.MultiHeadAttention(8, 12, 30, 0.0, 3),
        "mha-bidirectional": attnscope.MultiHeadAttention(8, 12, 30, 0.0, 3, causal=False),
        "gqa-rope": GroupedQueryAttention(8, 16, 4, 2),
        "mqa-window": GroupedQueryAttention(8, 16, 4, 1, window=5),
        "gqa-alibi": GroupedQueryAttention(8, 16, 4, 2, alibi=True),
        "qknorm-interleaved": GroupedQueryAttention(
            8, 16, 4, 4, qk_norm="per-head", rope_pairing="interleaved"
        ),
        "alibi-window": GroupedQueryAttention(8, 16, 4, 2, alibi=True, window=4),
    }


MODULES = _modules()


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("name", list(MODULES))
def test_row_trace_equals_rows_of_the_full_trace(name, batched):
    module = MODULES[name]
    torch.manual_seed(3)
    x = torch.randn(2, 23, 8) if batched else torch.randn(23, 8)
    rows = [22, 3, 0]
    full, rt = module.trace(x), attnscope.trace(module, x, rows=rows, block=4)
    assert rt.rows == tuple(rows) and full.rows is None
    assert list(rt.stages) == list(full.stages)
    matrix = {s.value for s in MATRIX_STAGES}
    for stage, tensor in rt.stages.items():
        want = full[stage][..., rows, :] if stage in matrix else full[stage]
        torch.testing.assert_close(tensor, want, atol=1e-5, rtol=1e-5)
    assert all(c.ok for c in rt.shape_checks())
    assert rt.predicted_shape("weights") == (*full["weights"].shape[:-2], 3, 23)
    assert rt.walk(3).matches and rt.walk(22).matches
    with pytest.raises(attnscope.AttnScopeError, match="traced rows"):
        rt.walk(5)
    for field in SUMMARY_FIELDS:
        torch.testing.assert_close(
            getattr(rt.summary, field), getattr(full.summary, field), atol=1e-4, rtol=1e-4
        )
    assert torch.equal(rt.summary.max_key, full.summary.max_key)
    assert rt.summary.entropy.shape == full["context"].shape[:-1]


@pytest.mark.parametrize("name", ["v1", "causal", "mha", "gqa-rope"])
def test_row_trace_lets_the_values_go_and_makes_them_again(name):
    """A row trace does not hold its values once every context is made (nothing refers to
    the value projection's output when the output projection runs, nor after the trace
    returns); read, they are made again, bit for bit the full trace's, and held from then
    on."""
    import weakref

    module = MODULES[name]
    made, alive_at_output = [], []
    x = torch.randn(2, 19, 8)
    if isinstance(module.W_value, torch.nn.Module):  # V1's is a bare parameter, no hook
        hooks = [
            module.W_value.register_forward_hook(lambda m, i, out: made.append(weakref.ref(out)))
        ]
        if hasattr(module, "out_proj"):
            hooks.append(
                module.out_proj.register_forward_pre_hook(
                    lambda m, i: alive_at_output.append(any(r() is not None for r in made))
                )
            )
        try:
            rt = module.trace(x, rows=[0, 18])
        finally:
            for hook in hooks:
                hook.remove()
        assert made and not any(alive_at_output)
    else:
        rt = module.trace(x, rows=[0, 18])
    assert not rt.stages.is_held("values") and "values" in rt and "values" in rt.stages
    assert "values (made when read)" in repr(rt.stages)
    assert all(ref() is None for ref in made)  # let go, not merely hidden
    assert torch.equal(rt["values"], module.trace(x)["values"])
    assert rt.stages.is_held("values") and rt["values"] is rt.stages["values"]


def test_row_trace_values_refuse_a_changed_module_or_input():
    """Values made again from weights or an input changed since would be another
    computation's: refused, with what to do."""
    torch.manual_seed(2)
    module = GroupedQueryAttention(8, 16, 4, 2)
    x = torch.randn(2, 9, 8)
    rt = module.trace(x, rows=[3])
    with torch.no_grad():
        module.W_value.weight.mul_(2.0)
    with pytest.raises(attnscope.AttnScopeError, match="unchanged.*trace again"):
        rt["values"]
    rt = module.trace(x, rows=[3])
    x.add_(1.0)
    with pytest.raises(attnscope.AttnScopeError, match="unchanged"):
        rt.stages["values"]
    rt = module.trace(x, rows=[3])
    module.W_value = torch.nn.Linear(8, 8, bias=False)  # replaced, not changed in place
    with pytest.raises(attnscope.AttnScopeError, match="unchanged"):
        rt["values"]


def test_row_trace_summary_left_for_later_uses_the_values_made_again():
    torch.manual_seed(4)
    module = MODULES["gqa-alibi"]
    for x in (torch.randn(2, 13, 8), torch.randn(13, 8)):
        later, now = module.trace(x, rows=[5], summary=False), module.trace(x, rows=[5])
        for field in SUMMARY_FIELDS:
            torch.testing.assert_close(getattr(later.summary, field), getattr(now.summary, field))


def test_row_trace_of_cross_attention():
    torch.manual_seed(5)
    module = GroupedQueryAttention(8, 16, 4, 2, cross=True)
    x, ctx = torch.randn(2, 7, 8), torch.randn(2, 11, 8)
    full, rt = module.trace(x, context=ctx), module.trace(x, context=ctx, rows=[6, 1])
    torch.testing.assert_close(rt["weights"], full["weights"][..., [6, 1], :])
    torch.testing.assert_close(rt.result, full.result, atol=1e-6, rtol=1e-5)
    assert rt["weights"].shape == (2, 4, 2, 11) and rt.walk(1).matches
    assert torch.equal(rt["values"], full["values"])  # made again from the context


def test_row_trace_negative_rows_and_errors():
    module = MODULES["mha"]
    x = torch.randn(10, 8)
    assert module.trace(x, rows=[-1]).rows == (9,)
    for rows, match in (([10], "from 0 to 9"), ([], "at least one"), ([1, 1], "distinct")):
        with pytest.raises(attnscope.AttnScopeError, match=match):
            module.trace(x, rows=rows)
    with pytest.raises(attnscope.AttnScopeError, match="rows"):
        attnscope.trace(object(), x, rows=[1])


def test_row_trace_of_simplified_attention():
    """Weightless attention has row traces too: its scores unscaled, its rows the full
    trace's rows, its summary the full trace's."""
    x = torch.randn(2, 17, 3)
    full, rt = attnscope.trace("simplified", x), attnscope.trace("simplified", x, rows=[16, 2])
    assert list(rt.stages) == ["scores", "weights", "context"]
    torch.testing.assert_close(rt["weights"], full["weights"][..., [16, 2], :])
    torch.testing.assert_close(rt["context"], full["context"], atol=1e-6, rtol=1e-5)
    for field in SUMMARY_FIELDS:
        torch.testing.assert_close(getattr(rt.summary, field), getattr(full.summary, field))
    assert rt.walk(2).matches


def test_row_trace_of_a_long_input_stays_small():
    """2,048 tokens, two rows: the matrix stages are (H, 2, T), the context whole."""
    torch.manual_seed(0)
    module = GroupedQueryAttention(16, 32, 4, 2, window=64)
    x = torch.randn(2048, 16)
    rt = module.trace(x, rows=[0, 2047], block=256)
    assert rt["weights"].shape == (4, 2, 2048)
    assert rt["context"].shape == (4, 2048, 8)
    torch.testing.assert_close(rt.result, module(x), atol=1e-5, rtol=1e-4)
    assert rt.walk(2047).matches
    assert (rt.summary.mean_distance <= 63 + 1e-3).all()


# --- the command line ------------------------------------------------------------------------


def test_cli_trace_rows(tmp_path, capsys):
    import numpy as np

    from attnscope.cli import main

    path = tmp_path / "x.npy"
    np.save(path, np.random.default_rng(0).standard_normal((300, 3)).astype("float32"))
    assert main(["trace", "--kind", "gqa", "--input", str(path), "--rows", "0,299"]) == 0
    out = capsys.readouterr().out
    assert "weights          (4, 2, 300)" in out and "rows: 0 (0), 299 (299)" in out
    assert "summary" in out and "walk: token 0" in out
    for argv, message in (
        (["--rows", "0,300"], "--rows: expected positions from 0 to 299 (300 tokens), got 300"),
        (["--rows", "x"], "expected query positions separated by commas"),
        (["--rows", "1", "--token", "2"], "--token: expected one of --rows 1"),
    ):
        assert main(["trace", "--input", str(path), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_a_row_trace_renders_its_chosen_rows():
    """HTML walks the first chosen query; heatmap rows are the chosen queries; a highlight
    must name one of them."""
    torch.manual_seed(0)
    layer = attnscope.GroupedQueryAttention(16, 16, 4, 2)
    labels = [f"t{i}" for i in range(40)]
    t = layer.trace(torch.randn(40, 16), labels=labels, rows=[0, 39])
    html = t.to_html()
    assert "Single query: token 0" in html
    fig = t.plot("weights")
    rows = [tick.get_text() for tick in fig.axes[0].get_yticklabels()]
    assert rows == ["t0", "t39"]
    with pytest.raises(attnscope.AttnScopeError, match="expected a query among the traced"):
        t.plot("weights", highlight=(5, 3))


# --- summaries: the softmax's normaliser, no autograd ------------------------------------------


@FAST
@given(cases)
def test_summary_logsumexp_is_the_rows_normaliser(c):
    q, kk, v, causal, window, slopes = _unpack(c)
    _, s = AF.attention_summary(
        q, kk, v, causal=causal, window=window, bias_slopes=slopes, block=c["block"]
    )
    _, record = _reference(q, kk, v, causal, window, slopes)
    logits = record[
        "masked_scores" if causal else "biased_scores" if slopes is not None else "scaled_scores"
    ]
    torch.testing.assert_close(s.logsumexp, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)
    assert AF.summarize_weights(record["weights"]).logsumexp is None


def test_blocked_refuses_tensors_that_need_grad():
    q, k, v = _tensors(0, 1, 2, 2, 6, 4, 4)
    q.requires_grad_(True)
    with pytest.raises(attnscope.AttnScopeError, match="without autograd"):
        AF.blocked_attention(q, k, v)
    with torch.no_grad():
        assert AF.blocked_attention(q, k, v).shape == (1, 2, 6, 4)


# --- pooled pictures of large matrices -------------------------------------------------------


def _pool_by_hand(matrix, visible, pool, reduce):
    """Tile by tile, with Python loops: the reference for pooled_matrix."""
    t, s = matrix.shape[-2:]
    rows, cols = -(-t // pool), -(-s // pool)
    out = torch.empty(*matrix.shape[:-2], rows, cols, dtype=torch.float64)
    hidden = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            tile = matrix[..., r * pool : (r + 1) * pool, c * pool : (c + 1) * pool].double()
            seen = visible[r * pool : (r + 1) * pool, c * pool : (c + 1) * pool]
            if not seen.any():
                hidden[r, c] = True
                out[..., r, c] = -torch.inf if reduce == "max" else torch.nan
                continue
            picked = tile[..., seen]
            out[..., r, c] = picked.amax(-1) if reduce == "max" else picked.mean(-1)
    return out, hidden


@FAST
@given(
    cases,
    st.integers(1, 7),
    st.sampled_from(["max", "mean"]),
    st.sampled_from([s.value for s in AF.POOLABLE]),
)
def test_pooled_matrix_equals_pooling_the_full_matrix(c, pool, reduce, stage):
    q, kk, v, causal, window, slopes = _unpack(c)
    _, record = _reference(q, kk, v, causal, window, slopes)
    if stage not in record:
        return
    got = AF.pooled_matrix(
        q,
        kk,
        stage=stage,
        pool=pool,
        reduce=reduce,
        causal=causal,
        window=window,
        bias_slopes=slopes,
    )
    tokens = q.shape[-2]
    visible = torch.ones(tokens, tokens, dtype=torch.bool)
    if "masked_scores" in record and stage in ("masked_scores", "weights"):
        visible = ~torch.isneginf(record["masked_scores"]).reshape(-1, tokens, tokens).all(0)
    want, hidden = _pool_by_hand(record[stage], visible, pool, reduce)
    assert got.values.shape == want.shape and torch.equal(got.hidden, hidden)
    torch.testing.assert_close(got.values.double(), want, atol=1e-4, rtol=1e-4, equal_nan=True)


@FAST
@given(cases, st.integers(1, 7), st.sampled_from(["max", "mean"]), st.data())
def test_several_stages_pooled_in_one_pass_equal_each_pooled_alone(c, pool, reduce, data):
    """One pass carries each block through the stages in place: every stage it pools
    equals that stage pooled on its own (the causal blocks it cannot skip included)."""
    q, kk, v, causal, window, slopes = _unpack(c)
    _, record = _reference(q, kk, v, causal, window, slopes)
    present = [s.value for s in AF.POOLABLE if s.value in record]
    names = data.draw(st.lists(st.sampled_from(present), min_size=1, unique=True))
    options = dict(pool=pool, reduce=reduce, causal=causal, window=window, bias_slopes=slopes)
    together = AF.pooled_matrices(q, kk, stages=names, **options)
    assert sorted(together) == sorted(names)
    for name in names:
        alone = AF.pooled_matrix(q, kk, stage=name, **options)
        got = together[name]
        assert got.stage == name and torch.equal(got.hidden, alone.hidden)
        torch.testing.assert_close(got.values, alone.values, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_a_row_traces_pooled_stages_are_made_in_one_pass_and_kept(monkeypatch):
    module, x = MODULES["gqa-alibi"], torch.randn(29, 8)
    rt = module.trace(x, rows=[0])
    calls = []
    real = AF.pooled_matrices
    monkeypatch.setattr(AF, "pooled_matrices", lambda *a, **k: calls.append(k) or real(*a, **k))
    for stage in ("scores", "scaled_scores", "biased_scores", "masked_scores", "weights"):
        assert rt.pooled(stage, pool=4).stage == stage
    rt.pooled("weights", pool=4, reduce="mean")
    assert [(len(k["stages"]), k["reduce"]) for k in calls] == [(5, "max"), (5, "mean")]


@pytest.mark.parametrize("name", ["mha", "gqa-alibi", "alibi-window", "mqa-window"])
def test_a_row_trace_pools_what_a_full_trace_pools(name):
    module, x = MODULES[name], torch.randn(29, 8)
    full, rt = module.trace(x), module.trace(x, rows=[0])
    for stage in AF.POOLABLE:
        if stage.value in full:
            for reduce in ("max", "mean"):
                a, b = (
                    full.pooled(stage, pool=4, reduce=reduce),
                    rt.pooled(stage, pool=4, reduce=reduce),
                )
                assert torch.equal(a.hidden, b.hidden)
                torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4, equal_nan=True)


def test_pooled_errors():
    q, k, _ = _tensors(0, 1, 2, 2, 6, 4, 4)
    for kwargs, match in (
        ({"stage": "context"}, "stage: expected one of scores"),
        ({"reduce": "median"}, "reduce: expected 'max' or 'mean'"),
        ({"pool": 0}, "pool: expected a positive integer"),
    ):
        with pytest.raises(attnscope.AttnScopeError, match=match):
            AF.pooled_matrix(q, k, **{"pool": 2, **kwargs})
    t = MODULES["v1"].trace(torch.randn(5, 8))
    with pytest.raises(attnscope.AttnScopeError, match="masked_scores"):
        t.pooled("masked_scores", pool=2)


def test_a_long_heatmap_is_drawn_pooled_without_the_matrix():
    """300 tokens: 3 x 3 tiles, 100 cells a side; the title says how; a highlight lands in
    the tile holding it; the row trace it is drawn from holds two rows."""
    torch.manual_seed(0)
    layer = GroupedQueryAttention(16, 16, 4, 2, window=40)
    t = layer.trace(torch.randn(300, 16), rows=[299])
    fig = t.plot("weights", highlight=(250, 230), reduce="mean")
    title = fig._suptitle.get_text()
    assert "mean over 3 x 3 tiles of (query, key): 300 queries x 300 keys in 100 x 100" in title
    assert "the tile holding query 250 and key 230" in title
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (100, 100)
    assert image.mask[0, 99] and not image.mask[99, 99]  # the future is hidden
    box = [p for p in fig.axes[0].patches if p.get_gid() == "highlight"][0]
    assert box.get_xy() == (230 // 3 - 0.5, 250 // 3 - 0.5)
    with pytest.raises(attnscope.AttnScopeError, match="reduce"):
        t.plot("weights", reduce="sum")


def test_cli_plot_of_a_long_input(tmp_path, capsys):
    import numpy as np

    from attnscope.cli import main

    path = tmp_path / "x.npy"
    np.save(path, np.random.default_rng(0).standard_normal((400, 3)).astype("float32"))
    for kind in ("simplified", "causal-multihead", "gqa"):
        out = tmp_path / f"{kind}.png"
        argv = ["plot", "--kind", kind, "--input", str(path), "-o", str(out), "--reduce", "mean"]
        assert main(argv) == 0, capsys.readouterr().err
        assert out.stat().st_size > 1000


# --- heads that stand out ----------------------------------------------------------------------


def _sink_layer():
    """Two heads reading features 0..3 and 4..7 as they are: token 0's key is large along
    feature 0, which every query has, so head 0 sends its weight there; head 1 sees plain
    noise."""
    layer = GroupedQueryAttention(8, 8, 2, 2, rope=False).eval()
    with torch.no_grad():
        for proj in (layer.W_query, layer.W_key, layer.W_value, layer.out_proj):
            proj.weight.copy_(torch.eye(8))
    torch.manual_seed(0)
    x = 0.1 * torch.randn(400, 8)
    x[:, 0] = 1.0
    x[0, 0] = 20.0
    return layer, x


def test_heads_that_stand_out_are_named():
    from attnscope.render.heads import profile_heads

    layer, x = _sink_layer()
    sink, plain = profile_heads(layer.trace(x, rows=[0]))
    assert sink.head == 0 and any(n.startswith("sink") for n in sink.notes)
    assert sink.sink_weight > 0.9 and plain.sink_weight < 0.05
    assert any(n.startswith("diffuse") for n in plain.notes)  # noise: near-uniform
    assert plain.reach == pytest.approx(0.5, abs=0.05)  # uniform over the past: half-way back
    # steep ALiBi slopes make the first heads local; a full trace gives the same profile
    torch.manual_seed(1)
    alibi = GroupedQueryAttention(8, 16, 4, 4, alibi=True).eval()
    y = torch.randn(200, 8)
    rows, full = profile_heads(alibi.trace(y, rows=[0])), profile_heads(alibi.trace(y))
    assert any(n.startswith("local") for n in rows[0].notes)
    for a, b in zip(rows, full, strict=True):
        assert a.notes == b.notes
        assert a.entropy == pytest.approx(b.entropy, rel=1e-4)


def test_cli_and_html_show_every_querys_summary(tmp_path, capsys):
    import numpy as np

    from attnscope.cli import main

    path = tmp_path / "x.npy"
    np.save(path, np.random.default_rng(0).standard_normal((300, 3)).astype("float32"))
    html = tmp_path / "t.html"
    argv = ["trace", "--kind", "gqa", "--input", str(path), "--rows", "299", "--html", str(html)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "heads: every query's summary, averaged over the later half (300 tokens)" in out
    assert "stands out" in out
    page = html.read_text()
    assert "Every query, summarised" in page and 'alt="entropy per head over positions"' in page
    assert "(300 tokens)" in page and "<code>299</code>" in page  # a short list of labels
    assert page.count("<code>1") < 20
