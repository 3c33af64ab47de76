"""attnscope.functional: one pure function per stage, on small hand-checkable inputs."""

from __future__ import annotations

import pytest
import torch

import attnscope
from attnscope import functional as AF
from attnscope.stages import Stage


@pytest.fixture
def inputs() -> torch.Tensor:
    return attnscope.book_embeddings()


def test_query_scores_loop_dot_and_vectorised_give_the_same_numbers(inputs):
    query = inputs[1]
    loop = AF.query_scores_loop(inputs, query)
    dot = AF.query_scores_dot(inputs, query)
    vec = AF.query_scores(inputs, query)
    assert loop.shape == dot.shape == vec.shape == (6,)
    assert torch.allclose(loop, dot, atol=1e-6) and torch.allclose(dot, vec, atol=1e-6)


def test_query_scores_loop_is_the_written_out_dot_product():
    inputs = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    query = torch.tensor([0.5, 2.0])
    assert AF.query_scores_loop(inputs, query).tolist() == [4.5, -0.5]


def test_attention_scores_row_i_column_j_is_query_i_dot_key_j():
    q = torch.arange(6.0).view(3, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    s = AF.attention_scores(q, k)
    assert s.shape == (3, 3)
    assert s[2, 1].item() == torch.dot(q[2], k[1]).item() == 5.0
    assert s[1, 2].item() == torch.dot(q[1], k[2]).item() == 5.0
    assert s[0, 0].item() == 0.0


def test_normalize_sum_keeps_proportions_and_sums_to_one():
    w = AF.normalize_sum(torch.tensor([1.0, 5.0, 2.0]))
    assert torch.allclose(w, torch.tensor([0.125, 0.625, 0.25]))
    w2 = AF.normalize_sum(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
    assert torch.allclose(w2, torch.tensor([[0.25, 0.75], [0.5, 0.5]]))


def test_naive_softmax_overflows_where_the_stable_one_does_not():
    big = torch.tensor([1000.0, 1001.0, 1002.0])
    assert torch.isnan(AF.softmax_naive(big)).all()
    stable = AF.softmax(big)
    assert torch.isfinite(stable).all()
    assert torch.allclose(stable, AF.softmax(torch.tensor([0.0, 1.0, 2.0])))


def test_softmax_gives_masked_keys_zero_weight():
    w = AF.softmax(torch.tensor([[0.3, -torch.inf, 1.0]]))
    assert w[0, 1].item() == 0.0 and torch.allclose(w.sum(-1), torch.ones(1))


def test_scale_scores_divides_by_the_square_root_of_d_k():
    s = torch.tensor([[4.0, 8.0]])
    assert torch.equal(AF.scale_scores(s, 16), torch.tensor([[1.0, 2.0]]))


def test_causal_mask_hides_exactly_the_keys_after_each_query():
    m = AF.causal_mask(4)
    assert m.dtype == torch.bool and m.shape == (4, 4)
    for i in range(4):
        for j in range(4):
            assert m[i, j].item() == (j > i)


def test_apply_causal_mask_sets_future_scores_to_minus_infinity_only():
    s = torch.arange(9.0).view(3, 3)
    masked = AF.apply_causal_mask(s)
    assert torch.isneginf(masked[AF.causal_mask(3)]).all()
    assert torch.equal(masked[~AF.causal_mask(3)], s[~AF.causal_mask(3)])
    # a larger mask buffer (context_length > tokens) is cropped, as the book's is
    big = torch.triu(torch.ones(5, 5), diagonal=1)
    assert torch.equal(AF.apply_causal_mask(s, big), masked)


def test_context_vectors_are_weighted_sums_of_value_rows():
    w = torch.tensor([[1.0, 0.0], [0.25, 0.75]])
    v = torch.tensor([[2.0, 4.0], [6.0, 8.0]])
    assert torch.equal(AF.context_vectors(w, v), torch.tensor([[2.0, 4.0], [5.0, 7.0]]))


def test_split_heads_gives_head_h_its_own_block_of_features():
    x = torch.arange(2 * 3 * 6.0).view(2, 3, 6)
    heads = AF.split_heads(x, 3)
    assert heads.shape == (2, 3, 3, 2)
    # head 1 of token 2 in batch 1 is features 2:4 of that token
    assert torch.equal(heads[1, 1, 2], x[1, 2, 2:4])
    assert torch.equal(AF.merge_heads(heads), x)


@pytest.mark.parametrize("causal", [False, True])
def test_attend_records_every_stage_by_name_in_pipeline_order(causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 5, 4).unbind(0)
    record: dict[str, torch.Tensor] = {}
    out = AF.attend(q, k, v, causal=causal, record=record)
    names = (
        ["scores", "scaled_scores"] + (["masked_scores"] if causal else []) + ["weights", "context"]
    )
    assert list(record) == names
    assert torch.equal(record["context"], out)
    assert torch.allclose(record["scaled_scores"], record["scores"] / 2.0)
    logits = record["masked_scores"] if causal else record["scaled_scores"]
    assert torch.equal(record["weights"], torch.softmax(logits, dim=-1))


@pytest.mark.parametrize("causal", [False, True])
def test_attend_without_a_record_computes_the_same_context(causal):
    """The unrecorded path works in place; it must not change the numbers or the inputs."""
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 2, 3, 7, 4).unbind(0)
    before = [t.clone() for t in (q, k, v)]
    recorded = AF.attend(q, k, v, causal=causal, record={})
    plain = AF.attend(q, k, v, causal=causal)
    assert torch.equal(recorded, plain)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v), strict=True))


def test_attend_in_place_path_keeps_gradients_right():
    torch.manual_seed(2)
    q, k, v = (torch.randn(4, 6, requires_grad=True) for _ in range(3))
    AF.attend(q, k, v, causal=True).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    AF.attend(q, k, v, causal=True, record={}).sum().backward()
    for g, t in zip(grads, (q, k, v), strict=True):
        assert torch.allclose(g, t.grad, atol=1e-6)


def test_attend_masked_scores_equal_masked_fill_with_minus_infinity():
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 6, 4).unbind(0)
    record: dict[str, torch.Tensor] = {}
    AF.attend(q, k, v, causal=True, record=record)
    expected = record["scaled_scores"].masked_fill(AF.causal_mask(6), -torch.inf)
    assert torch.equal(record["masked_scores"], expected)


def test_simplified_attention_records_scores_weights_context(inputs):
    record: dict[str, torch.Tensor] = {}
    out = AF.simplified_attention(inputs, record=record)
    assert list(record) == [Stage.SCORES.value, Stage.WEIGHTS.value, Stage.CONTEXT.value]
    assert torch.allclose(record["scores"], inputs @ inputs.T)
    assert out.shape == inputs.shape
