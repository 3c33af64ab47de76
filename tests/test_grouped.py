"""GroupedQueryAttention and the functional pieces of modern attention.

Against the book's own Llama 3 and Qwen 3 layers given the same weights; the rotary
embedding's defining properties; grouped heads, windows and ALiBi doing exactly what they
say; fast and explicit paths agreeing; traces and single-query walks of every variant.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnscope.functional as AF
from attnscope import AttnScopeError, GroupedQueryAttention

VARIANTS = {
    "llama": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "mha-rope": dict(),
    "qwen3": dict(num_kv_heads=2, qk_norm="per-head"),
    "olmo2": dict(num_kv_heads=4, qk_norm="full"),
    "interleaved": dict(num_kv_heads=2, rope_pairing="interleaved"),
    "neox-partial": dict(rope_fraction=0.25, rope_base=500_000.0),
    "mistral-window": dict(num_kv_heads=2, window=3),
    "alibi": dict(alibi=True),
    "alibi-6-heads": dict(alibi=True, num_heads=6, d_out=48),
    "not-causal": dict(causal=False, num_kv_heads=2),
    "cross": dict(cross=True, num_kv_heads=2),
}


def _layer(**kw) -> GroupedQueryAttention:
    args = dict(d_in=32, d_out=32, num_heads=4) | kw
    d_in, d_out, heads = args.pop("d_in"), args.pop("d_out"), args.pop("num_heads")
    torch.manual_seed(0)
    layer = GroupedQueryAttention(d_in, d_out, heads, **args).eval()
    if layer.qk_norm:  # not the ones they start as: a norm weight must matter
        with torch.no_grad():
            layer.q_norm.weight.uniform_(0.5, 1.5)
            layer.k_norm.weight.uniform_(0.5, 1.5)
    return layer


def _inputs(layer, batch=2, tokens=7):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, tokens, layer.d_in, generator=g)
    context = torch.randn(batch, 5, layer.d_in, generator=g) if layer.cross else None
    return x, context


# --- against the book's code ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3():
    """The book's Llama 3 code (it imports tiktoken, a test dependency)."""
    return pytest.importorskip("llms_from_scratch.llama3", reason="llms-from-scratch not installed")


@pytest.fixture(scope="module")
def qwen3():
    """The book's Qwen 3 code (it imports tiktoken, a test dependency)."""
    return pytest.importorskip("llms_from_scratch.qwen3", reason="llms-from-scratch not installed")


def _copy_projections(ours: GroupedQueryAttention, book) -> None:
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value", "out_proj"):
            getattr(ours, name).weight.copy_(getattr(book, name).weight)


def _book_inv_freq(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The book's frequencies, read back from its tables: the angle at position 1."""
    half = cos.shape[1] // 2
    return torch.atan2(sin[1, :half].double(), cos[1, :half].double()).float()


@pytest.mark.parametrize("kv_groups", [8, 2, 1])
@pytest.mark.parametrize("freq_config", [None, "llama3.2"])
def test_equals_the_books_llama3_grouped_query_attention(kv_groups, freq_config, llama3):
    """Same weights, same output as llms_from_scratch.llama3.GroupedQueryAttention, with the
    book's RoPE tables (Llama 3.2's scaled frequencies copied into ``inv_freq``)."""
    d, heads, tokens = 64, 8, 11
    torch.manual_seed(123)
    book = llama3.GroupedQueryAttention(d, d, heads, kv_groups)
    config = None
    if freq_config:
        config = dict(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=16
        )
    cos, sin = llama3.compute_rope_params(
        d // heads, theta_base=500_000.0, context_length=32, freq_config=config
    )
    mask = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1)
    ours = GroupedQueryAttention(d, d, heads, kv_groups, rope_base=500_000.0).eval()
    _copy_projections(ours, book)
    ours.inv_freq.copy_(_book_inv_freq(cos, sin))
    x = torch.randn(2, tokens, d)
    want = book(x, mask, cos, sin)
    for fast in (True, False):
        ours.use_fast_path = fast
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.trace(x).result, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_equals_the_books_qwen3_grouped_query_attention(qk_norm, qwen3):
    """Same weights, same output as llms_from_scratch.qwen3.GroupedQueryAttention (its own
    head_dim, QK RMSNorm per head, out_proj back to d_in)."""
    d_in, heads, kv, head_dim, tokens = 48, 4, 2, 16, 9
    torch.manual_seed(7)
    book = qwen3.GroupedQueryAttention(d_in, heads, kv, head_dim=head_dim, qk_norm=qk_norm)
    if qk_norm:
        with torch.no_grad():
            book.q_norm.scale.uniform_(0.5, 1.5)
            book.k_norm.scale.uniform_(0.5, 1.5)
    cos, sin = qwen3.compute_rope_params(head_dim, theta_base=1_000_000.0, context_length=16)
    mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), diagonal=1)
    ours = GroupedQueryAttention(
        d_in,
        d_in,
        heads,
        kv,
        head_dim=head_dim,
        rope_base=1_000_000.0,
        qk_norm="per-head" if qk_norm else None,
    ).eval()
    _copy_projections(ours, book)
    if qk_norm:
        with torch.no_grad():
            ours.q_norm.weight.copy_(book.q_norm.scale)
            ours.k_norm.weight.copy_(book.k_norm.scale)
    x = torch.randn(2, tokens, d_in)
    want = book(x, mask, cos, sin)
    for fast in (True, False):
        ours.use_fast_path = fast
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)


# --- the functional pieces -----------------------------------------------------------------


@pytest.mark.parametrize("pairing", AF.PAIRINGS)
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_rope_keeps_every_pairs_length(pairing, fraction):
    """A rotation: each rotated pair keeps its length, the unrotated features are untouched."""
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    freqs = AF.rope_frequencies(16, fraction=fraction)
    out = AF.apply_rope(x, AF.rope_angles(10, freqs), pairing)
    rot = AF.rotary_dims(16, fraction)

    def pair_lengths(t):
        part = t[..., :rot]
        if pairing == "half":
            a, b = part[..., : rot // 2], part[..., rot // 2 :]
        else:
            a, b = part[..., 0::2], part[..., 1::2]
        return a.square() + b.square()

    torch.testing.assert_close(pair_lengths(out), pair_lengths(x))
    assert torch.equal(out[..., rot:], x[..., rot:])
    assert not torch.allclose(out[..., 1:, :rot], x[..., 1:, :rot])  # it did rotate


@pytest.mark.parametrize("pairing", AF.PAIRINGS)
@given(m=st.integers(0, 40), n=st.integers(0, 40), shift=st.integers(1, 100))
@settings(max_examples=30, deadline=None)
def test_rope_score_depends_on_distance_only(pairing, m, n, shift):
    """q rotated to position m against k rotated to n: shifting both leaves the score."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 8, generator=g, dtype=torch.float64)
    freqs = AF.rope_frequencies(8)

    def score(pos_q, pos_k):
        rq = AF.apply_rope(q, AF.rope_angles(1, freqs, pos_q), pairing)
        rk = AF.apply_rope(k, AF.rope_angles(1, freqs, pos_k), pairing)
        return (rq * rk).sum()

    torch.testing.assert_close(score(m, n), score(m + shift, n + shift))


def test_rope_at_position_zero_is_the_identity():
    x = torch.randn(1, 8)
    assert torch.equal(AF.apply_rope(x, AF.rope_angles(1, AF.rope_frequencies(8))), x)


def test_repeat_kv_gives_query_head_h_the_kv_head_h_over_group():
    """Head h of the repeated keys is key/value head h // group (repeat_interleave)."""
    kv = torch.arange(3.0).view(1, 3, 1, 1).expand(1, 3, 2, 4)
    out = AF.repeat_kv(kv, 4)
    assert [int(out[0, h, 0, 0]) for h in range(12)] == [AF.kv_head_of(h, 12, 3) for h in range(12)]
    assert [AF.kv_head_of(h, 12, 3) for h in range(12)] == [h // 4 for h in range(12)]


def test_sliding_window_shows_exactly_the_last_window_keys():
    hide = AF.sliding_window_mask(6, 3)
    for i in range(6):
        seen = [j for j in range(6) if not hide[i, j]]
        assert seen == list(range(max(0, i - 2), i + 1))


def test_alibi_slopes_are_the_papers():
    """8 heads: 1/2, 1/4, ... 1/256 (Press et al.); 12 heads: 8's then every other of 16's."""
    assert AF.alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    sixteen = AF.alibi_slopes(16).tolist()
    assert AF.alibi_slopes(12).tolist() == AF.alibi_slopes(8).tolist() + sixteen[0::2][:4]


def test_alibi_bias_is_minus_slope_times_distance():
    bias = AF.alibi_bias(torch.tensor([0.5, 0.25]), 4)
    assert bias.shape == (2, 4, 4)
    assert bias[0, 3, 0] == -1.5 and bias[1, 3, 1] == -0.5 and bias[0, 2, 2] == 0


def test_rms_norm_gives_unit_root_mean_square():
    out = AF.rms_norm(torch.randn(5, 16, dtype=torch.float64) * 7, eps=0.0)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(5, dtype=torch.float64))


# --- the module ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
def test_fast_and_explicit_paths_agree(name):
    layer = _layer(**VARIANTS[name])
    x, context = _inputs(layer)
    fast = layer(x, context)
    layer.use_fast_path = False
    torch.testing.assert_close(layer(x, context), fast, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.trace(x, context=context).result, fast, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in ("not-causal", "cross")])
def test_causal_outputs_ignore_future_tokens(name):
    layer = _layer(**VARIANTS[name])
    x, _ = _inputs(layer)
    changed = x.clone()
    changed[:, 4:] += 3.0
    torch.testing.assert_close(layer(changed)[:, :4], layer(x)[:, :4])


def test_window_hides_keys_further_back_than_the_window():
    """With window 3, token 6's output ignores tokens 0..3 and depends on 4."""
    layer = _layer(num_kv_heads=2, window=3)
    x, _ = _inputs(layer)
    far, near = x.clone(), x.clone()
    far[:, :4] += 3.0
    near[:, 4] += 3.0
    torch.testing.assert_close(layer(far)[:, 6], layer(x)[:, 6])
    assert not torch.allclose(layer(near)[:, 6], layer(x)[:, 6])


def test_query_head_reads_its_groups_kv_head():
    """Zeroing key/value head 1's value weights changes exactly query heads 2 and 3 (of 4,
    group 2): their context, and no other head's."""
    layer = _layer(num_kv_heads=2)
    x, _ = _inputs(layer)
    before = layer.trace(x)["context"]
    with torch.no_grad():
        layer.W_value.weight[layer.head_dim : 2 * layer.head_dim] = 0
    after = layer.trace(x)["context"]
    changed = [h for h in range(4) if not torch.allclose(before[:, h], after[:, h])]
    assert changed == [2, 3]


@pytest.mark.parametrize("name", VARIANTS)
def test_trace_names_the_new_stages_and_predicts_every_shape(name):
    layer = _layer(**VARIANTS[name])
    x, context = _inputs(layer)
    t = layer.trace(x, context=context)
    kw = VARIANTS[name]
    assert ("normed_queries" in t) == bool(kw.get("qk_norm"))
    assert ("rotated_keys" in t) == layer.rope
    assert ("biased_scores" in t) == bool(kw.get("alibi"))
    assert ("masked_scores" in t) == layer.causal
    bad = [c for c in t.shape_checks() if not c.ok]
    assert not bad, bad
    assert t["keys"].shape[1] == layer.num_kv_heads
    weights = t["weights"]
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


@pytest.mark.parametrize("name", VARIANTS)
def test_walk_one_query_of_every_variant(name):
    """The query computed alone (projected, normed, rotated at its position) and its context
    equal its row of the batch."""
    layer = _layer(**VARIANTS[name])
    x, context = _inputs(layer)
    t = layer.trace(x, context=context)
    for token in (0, 3, 6):
        w = t.walk(token, batch=1)
        assert w.matches, (token, w.max_abs_diff)
        assert w.query.shape == (layer.num_heads, layer.head_dim)
        assert (w.biased_scores is not None) == layer.alibi


def test_unbatched_input_keeps_its_shape():
    layer = _layer(num_kv_heads=2)
    x, _ = _inputs(layer)
    torch.testing.assert_close(layer(x[0]), layer(x)[0], rtol=1e-5, atol=1e-6)
    assert layer.trace(x[0])["keys"].shape == (2, 7, 8)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(num_kv_heads=3), "num_kv_heads: expected a divisor of num_heads=4, got 3"),
        (dict(qk_norm="layer"), "qk_norm: expected None or one of per-head, full"),
        (dict(window=4, causal=False), "window: expected causal=True"),
        (dict(cross=True, rope=True), "cross: expected a cross-attention layer without"),
        (dict(rope_pairing="complex"), "rope_pairing: expected one of half, interleaved"),
        (dict(rope_fraction=0.01), "fraction: expected at least one rotated pair"),
        (dict(rope_base=1.0), "base: expected a number above 1"),
    ],
)
def test_bad_arguments_get_one_clear_message(kwargs, words):
    with pytest.raises(AttnScopeError, match=words.replace("(", r"\(")):
        _layer(**kwargs)


def test_cross_attention_needs_its_context_and_self_attention_refuses_one():
    cross, plain = _layer(cross=True), _layer()
    x, context = _inputs(cross)
    with pytest.raises(AttnScopeError, match="context: expected the"):
        cross(x)
    with pytest.raises(AttnScopeError, match="context: expected None"):
        plain(x, context)
    with pytest.raises(AttnScopeError, match="context: expected None"):
        _layer().trace(x, context=context)


def test_scores_of_a_rotated_layer_depend_on_distance_only():
    """The seed's check for RoPE: the same two tokens at positions shifted together give the
    same scores (offset moves every position)."""
    layer = _layer(num_kv_heads=2)
    layer.use_fast_path = False
    x, _ = _inputs(layer)
    torch.testing.assert_close(layer(x, offset=13), layer(x), rtol=1e-4, atol=1e-5)


def test_the_books_modern_modules_import_where_the_book_is_installed():
    """Where llms-from-scratch is installed, its llama3 and qwen3 modules import (their
    tiktoken is a test dependency): the comparisons above must run, not skip."""
    pytest.importorskip("llms_from_scratch", reason="llms-from-scratch not installed")
    import llms_from_scratch.llama3  # noqa: F401
    import llms_from_scratch.qwen3  # noqa: F401
