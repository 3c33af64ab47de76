"""The modules: shapes, weight carrying, the fast and explicit paths, masking, dropout."""

from __future__ import annotations

import pytest
import torch

import attnscope
from attnscope import CausalAttention, MultiHeadAttention, SelfAttentionV1, SelfAttentionV2


@pytest.fixture
def inputs() -> torch.Tensor:
    return attnscope.book_embeddings()


def _modules():
    torch.manual_seed(0)
    return [
        SelfAttentionV1(3, 4),
        SelfAttentionV2(3, 4),
        SelfAttentionV2(3, 4, qkv_bias=True),
        CausalAttention(3, 4, context_length=8, dropout=0.0),
        MultiHeadAttention(3, 4, 8, 0.0, num_heads=2),
        MultiHeadAttention(3, 4, 8, 0.0, num_heads=2, causal=False),
        MultiHeadAttention(3, 4, 8, 0.0, num_heads=2, use_fast_path=False),
    ]


@pytest.mark.parametrize("index", range(7))
def test_every_module_keeps_the_leading_shape_and_gives_d_out_columns(inputs, index):
    module = _modules()[index]
    assert module(inputs).shape == (6, 4)
    assert module(torch.stack((inputs, inputs))).shape == (2, 6, 4)


@pytest.mark.parametrize("index", range(7))
def test_batched_rows_equal_each_sequence_run_alone(inputs, index):
    module = _modules()[index]
    other = inputs.flip(0) * 0.7
    batched = module(torch.stack((inputs, other)))
    assert torch.allclose(batched[0], module(inputs), atol=1e-6)
    assert torch.allclose(batched[1], module(other), atol=1e-6)


def test_v1_from_v2_and_back_compute_the_same_output(inputs):
    torch.manual_seed(789)
    v2 = SelfAttentionV2(3, 2)
    v1 = SelfAttentionV1.from_v2(v2)
    assert torch.equal(v1.W_query.data, v2.W_query.weight.data.T)
    assert torch.allclose(v1(inputs), v2(inputs), atol=1e-7)
    back = SelfAttentionV2.from_v1(v1)
    assert torch.allclose(back(inputs), v2(inputs), atol=1e-7)


def test_conversions_keep_dtype_and_leave_the_global_random_state_alone(inputs):
    v2 = SelfAttentionV2(3, 2).double()
    state = torch.random.get_rng_state()
    v1 = SelfAttentionV1.from_v2(v2)
    back = SelfAttentionV2.from_v1(v1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert v1.W_query.dtype == back.W_query.weight.dtype == torch.float64
    assert torch.equal(back.W_key.weight, v2.W_key.weight)
    with torch.no_grad():
        assert torch.allclose(v1(inputs.double()), v2(inputs.double()), atol=1e-12)


def test_forward_reads_the_weight_parameters_and_leaves_them_unchanged(inputs):
    torch.manual_seed(123)
    module = MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    module(inputs)
    module.trace(inputs)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_attention_weights_change_with_the_input_while_parameters_stay(inputs):
    torch.manual_seed(123)
    module = SelfAttentionV1(3, 2)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    w1 = module.trace(inputs)["weights"]
    w2 = module.trace(inputs * 2)["weights"]
    assert not torch.allclose(w1, w2)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


@pytest.mark.parametrize("causal", [True, False])
def test_multihead_fast_path_equals_explicit_path_with_gradients(causal):
    torch.manual_seed(5)
    fast = MultiHeadAttention(8, 8, 10, 0.0, num_heads=4, causal=causal)
    slow = MultiHeadAttention(8, 8, 10, 0.0, num_heads=4, causal=causal, use_fast_path=False)
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(3, 10, 8, requires_grad=True)
    out_fast = fast(x)
    out_fast.square().sum().backward()
    grad_fast = x.grad.clone()
    x.grad = None
    out_slow = slow(x)
    out_slow.square().sum().backward()
    assert torch.allclose(out_fast, out_slow, atol=1e-5)
    assert torch.allclose(grad_fast, x.grad, atol=1e-5)
    for (n, p), (_, q) in zip(fast.named_parameters(), slow.named_parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


def test_multihead_kind_names_the_causal_mask():
    assert MultiHeadAttention(4, 4, 4, 0.0, 2).kind == "causal-multihead"
    assert MultiHeadAttention(4, 4, 4, 0.0, 2, causal=False).kind == "multihead"
    assert CausalAttention(4, 4, 4, 0.0).kind == "causal"
    assert SelfAttentionV1(4, 4).kind == "self"


def test_causal_attention_first_token_attends_only_to_itself(inputs):
    torch.manual_seed(0)
    module = CausalAttention(3, 2, 6, 0.0)
    tr = module.trace(inputs)
    assert tr["weights"][0, 0].item() == pytest.approx(1.0)
    # the first output row is the first value row
    assert torch.allclose(tr["context"][0], tr["values"][0])


def test_causal_attention_accepts_fewer_tokens_than_context_length(inputs):
    module = CausalAttention(3, 2, context_length=10, dropout=0.0)
    assert module(inputs[:3]).shape == (3, 2)


def test_dropout_applies_in_training_only():
    torch.manual_seed(0)
    module = MultiHeadAttention(4, 4, 6, 0.5, num_heads=2, use_fast_path=False)
    x = torch.randn(2, 6, 4)
    module.eval()
    a, b = module(x), module(x)
    assert torch.equal(a, b)
    module.train()
    torch.manual_seed(1)
    c = module(x)
    assert not torch.allclose(a, c)


def test_float64_modules_accept_float64_input(inputs):
    module = SelfAttentionV2(3, 2).double()
    assert module(inputs.double()).dtype == torch.float64


def test_the_books_modules_hold_no_context_length_squared_mask():
    """65,536 tokens of context cost no (T, T) buffer: masks are built per call."""
    for module in (
        attnscope.CausalAttention(3, 2, 65_536, 0.0),
        attnscope.MultiHeadAttention(4, 4, 65_536, 0.0, num_heads=2),
    ):
        assert list(module.buffers()) == []


def test_state_dicts_move_both_ways_with_the_books_classes():
    """The book's state dict (with its mask) loads into ours, and ours into the book's."""
    book = pytest.importorskip("llms_from_scratch.ch03", reason="llms-from-scratch not installed")
    torch.manual_seed(0)
    theirs = book.MultiHeadAttention(4, 4, 6, 0.0, num_heads=2)
    ours = attnscope.MultiHeadAttention(4, 4, 6, 0.0, num_heads=2)
    ours.load_state_dict(theirs.state_dict())  # strict: the mask is accepted
    x = torch.randn(2, 6, 4)
    torch.testing.assert_close(ours(x), theirs(x))
    again = book.MultiHeadAttention(4, 4, 6, 0.0, num_heads=2)
    again.load_state_dict(ours.state_dict())  # strict: ours writes the mask it expects
    torch.testing.assert_close(again(x), theirs(x))
    causal_theirs = book.CausalAttention(4, 2, 6, 0.0)
    attnscope.CausalAttention(4, 2, 6, 0.0).load_state_dict(causal_theirs.state_dict())
