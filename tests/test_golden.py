"""The book's and the seeds' printed numbers, reproduced to the 4 decimals they print.

Every expected number here is copied from "Build a Large Language Model From Scratch"
(ch. 3) or from the seed articles, not computed by attnscope.
"""

from __future__ import annotations

import pytest
import torch

import attnscope
from attnscope import functional as AF

BOOK_ATOL = 6e-5  # printed to 4 decimals: agree to the rounding


def close(actual: torch.Tensor, expected: list) -> bool:
    expected_t = torch.tensor(expected, dtype=torch.float64)
    actual_t = actual.detach().double()
    return actual_t.shape == expected_t.shape and bool(
        (actual_t - expected_t).abs().max() <= BOOK_ATOL
    )


@pytest.fixture
def inputs() -> torch.Tensor:
    return attnscope.book_embeddings()


# --- simplified attention (book 3.3) ---------------------------------------------------------


def test_simplified_scores_of_journey_match_the_book(inputs):
    """Scores of the query "journey" (token 1) against every token: 0.9544 1.4950 ..."""
    scores = AF.query_scores(inputs, inputs[1])
    assert close(scores, [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])


def test_simplified_sum_normalised_weights_match_the_book(inputs):
    weights = AF.normalize_sum(AF.query_scores(inputs, inputs[1]))
    assert close(weights, [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])


@pytest.mark.parametrize("softmax", [AF.softmax_naive, AF.softmax], ids=["naive", "stable"])
def test_simplified_softmax_weights_match_the_book(inputs, softmax):
    weights = softmax(AF.query_scores(inputs, inputs[1]), dim=0)
    assert close(weights, [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])


def test_simplified_context_of_journey_matches_the_book(inputs):
    weights = AF.softmax(AF.query_scores(inputs, inputs[1]), dim=0)
    assert close(weights @ inputs, [0.4419, 0.6515, 0.5683])


def test_simplified_all_context_vectors_match_the_book(inputs):
    """The book's all_context_vecs, and the trace of "simplified" gives the same rows."""
    expected = [
        [0.4421, 0.5931, 0.5790],
        [0.4419, 0.6515, 0.5683],
        [0.4431, 0.6496, 0.5671],
        [0.4304, 0.6298, 0.5510],
        [0.4671, 0.5910, 0.5266],
        [0.4177, 0.6503, 0.5645],
    ]
    assert close(AF.simplified_attention(inputs), expected)
    assert close(attnscope.trace("simplified", inputs)["context"], expected)


def test_toy_scores_normalise_as_the_seed_says():
    """cat/sat/mat = 1, 5, 2: by the sum 0.125 0.625 0.25; softmax about 0.017 0.936 0.047."""
    scores = attnscope.toy_scores()
    assert close(AF.normalize_sum(scores), [0.125, 0.625, 0.25])
    soft = AF.softmax(scores, dim=0)
    assert close(soft, [0.0171, 0.9362, 0.0466])
    assert torch.allclose(soft, torch.tensor([0.017, 0.936, 0.047]), atol=5e-4)


# --- self-attention with trainable weights (book 3.4) -----------------------------------------


@pytest.fixture
def v1_trace(inputs):
    torch.manual_seed(123)
    return attnscope.SelfAttentionV1(3, 2).trace(inputs)


def test_v1_query_of_journey_matches_the_book(v1_trace):
    assert close(v1_trace.walk(1).query, [0.4306, 1.4551])
    assert close(v1_trace["queries"][1], [0.4306, 1.4551])


def test_v1_scores_weights_and_context_of_journey_match_the_book(v1_trace):
    walk = v1_trace.walk(1)
    assert close(walk.scores, [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440])
    assert close(walk.weights, [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820])
    assert close(walk.context, [0.3061, 0.8210])


def test_v1_batched_output_matches_the_book(inputs):
    torch.manual_seed(123)
    out = attnscope.SelfAttentionV1(3, 2)(inputs)
    expected = [
        [0.2996, 0.8053],
        [0.3061, 0.8210],
        [0.3058, 0.8203],
        [0.2948, 0.7939],
        [0.2927, 0.7891],
        [0.2990, 0.8040],
    ]
    assert close(out, expected)


def test_v2_with_seed_789_matches_the_book(inputs):
    torch.manual_seed(789)
    out = attnscope.SelfAttentionV2(3, 2)(inputs)
    assert close(out[0], [-0.0739, 0.0713])
    assert close(out[-1], [-0.0754, 0.0693])


# --- causal and multi-head (book 3.5, 3.6) ----------------------------------------------------


def test_causal_attention_with_seed_123_matches_the_book(inputs):
    torch.manual_seed(123)
    batch = torch.stack((inputs, inputs))
    out = attnscope.CausalAttention(3, 2, context_length=6, dropout=0.0)(batch)
    assert out.shape == (2, 6, 2)
    assert close(out[0, 0], [-0.4519, 0.2216])
    assert close(out[1, -1], [-0.5299, -0.1081])


def test_multihead_attention_with_seed_123_matches_the_book(inputs):
    torch.manual_seed(123)
    batch = torch.stack((inputs, inputs))
    out = attnscope.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)(batch)
    assert out.shape == (2, 6, 2)
    assert close(out[0, 0], [0.3190, 0.4858])
    assert close(out[1, -1], [0.2575, 0.4028])


# --- against the book's own code --------------------------------------------------------------


@pytest.fixture
def book_ch03():
    try:
        from llms_from_scratch import ch03
    except ImportError:
        pytest.skip(
            "llms_from_scratch (the book's code) is not installed: pip install llms-from-scratch"
        )
    return ch03


@pytest.mark.parametrize(
    ("ours_name", "book_name", "seed"),
    [("SelfAttentionV1", "SelfAttention_v1", 123), ("SelfAttentionV2", "SelfAttention_v2", 789)],
)
def test_our_v1_v2_equal_the_books_with_the_same_seed(
    book_ch03, inputs, ours_name, book_name, seed
):
    """Unbatched only: the book's V1 and V2 use keys.T, which needs a 2-D input."""
    torch.manual_seed(seed)
    ours = getattr(attnscope, ours_name)(3, 2)
    torch.manual_seed(seed)
    book = getattr(book_ch03, book_name)(3, 2)
    assert torch.allclose(ours(inputs), book(inputs), atol=1e-6)


def test_our_causal_attention_equals_the_books_with_the_same_seed(book_ch03, inputs):
    x = torch.stack((inputs, inputs.flip(0)))
    torch.manual_seed(123)
    ours = attnscope.CausalAttention(3, 4, 6, 0.0)
    torch.manual_seed(123)
    book = book_ch03.CausalAttention(3, 4, 6, 0.0)
    assert torch.allclose(ours(x), book(x), atol=1e-6)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "explicit"])
def test_our_multihead_attention_equals_the_books_with_seed_123(book_ch03, inputs, fast):
    """Same seed, same constructor order: same weights and the same output, both paths."""
    x = torch.stack((inputs, inputs.flip(0)))
    torch.manual_seed(123)
    ours = attnscope.MultiHeadAttention(3, 4, 6, 0.0, num_heads=2, use_fast_path=fast)
    torch.manual_seed(123)
    book = book_ch03.MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)
    for (name, p), (book_name, q) in zip(
        ours.state_dict().items(), book.state_dict().items(), strict=True
    ):
        assert name == book_name and torch.equal(p, q)
    assert torch.allclose(ours(x), book(x), atol=1e-6)
