"""Traces: stages by name in pipeline order, predicted against actual shapes, the walk."""

from __future__ import annotations

import pytest
import torch

import attnscope
from attnscope import CausalAttention, MultiHeadAttention, SelfAttentionV1, SelfAttentionV2
from attnscope.errors import AttnScopeError
from attnscope.stages import stages_for_kind


@pytest.fixture
def inputs() -> torch.Tensor:
    return attnscope.book_embeddings()


def _traced(kind: str, x: torch.Tensor):
    torch.manual_seed(123)
    if kind == "simplified":
        return attnscope.trace("simplified", x)
    module = {
        "self": lambda: SelfAttentionV1(x.shape[-1], 4),
        "causal": lambda: CausalAttention(x.shape[-1], 4, x.shape[-2], 0.0),
        "multihead": lambda: MultiHeadAttention(x.shape[-1], 4, x.shape[-2], 0.0, 2, causal=False),
        "causal-multihead": lambda: MultiHeadAttention(x.shape[-1], 4, x.shape[-2], 0.0, 2),
    }[kind]()
    return module.trace(x)


KINDS = ["simplified", "self", "causal", "multihead", "causal-multihead"]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_trace_has_the_kinds_stages_in_order_with_predicted_shapes(inputs, kind, batched):
    x = torch.stack((inputs, inputs.flip(0))) if batched else inputs
    tr = _traced(kind, x)
    assert tr.kind == kind
    assert list(tr) == [s.value for s in stages_for_kind(kind)]
    checks = tr.shape_checks()
    assert [c.stage.value for c in checks] == list(tr)
    assert all(c.ok for c in checks), [(c.stage, c.predicted, c.actual) for c in checks]


@pytest.mark.parametrize("kind", KINDS)
def test_trace_output_equals_the_modules_forward(inputs, kind):
    tr = _traced(kind, inputs)
    if tr.module is None:
        expected = attnscope.functional.simplified_attention(inputs)
    else:
        with torch.no_grad():
            expected = tr.module(inputs)
    assert torch.allclose(tr.result, expected, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_the_walk_of_every_token_equals_its_batched_row(inputs, kind):
    tr = _traced(kind, inputs)
    for token in range(6):
        walk = tr.walk(token)
        assert walk.matches, (token, walk.max_abs_diff)
        assert torch.allclose(walk.weights.sum(-1), torch.ones(()), atol=1e-6)


def test_walk_of_a_batched_trace_uses_the_chosen_sequence(inputs):
    x = torch.stack((inputs, inputs.flip(0) * 0.5))
    tr = _traced("causal-multihead", x)
    walk = tr.walk(2, batch=1)
    assert walk.matches
    assert torch.equal(walk.batched_context, tr["context"][1, :, 2, :])


def test_walk_shows_the_scores_of_one_query_row(inputs):
    tr = _traced("self", inputs)
    walk = tr.walk(1)
    assert torch.allclose(walk.scores, tr["scores"][1], atol=1e-6)
    assert torch.allclose(walk.scaled_scores, tr["scaled_scores"][1], atol=1e-6)
    assert walk.masked_scores is None


def test_causal_walk_masks_keys_after_the_query(inputs):
    walk = _traced("causal", inputs).walk(2)
    assert torch.isneginf(walk.masked_scores[3:]).all()
    assert (walk.weights[3:] == 0).all()


def test_trace_labels_default_to_positions_and_can_be_given(inputs):
    tr = _traced("simplified", inputs)
    assert tr.labels == ("0", "1", "2", "3", "4", "5")
    named = attnscope.trace("simplified", inputs, labels=attnscope.BOOK_TOKENS)
    assert named.walk(1).label == "journey"


def test_trace_indexing_by_stage_enum_and_membership(inputs):
    tr = _traced("causal", inputs)
    assert torch.equal(tr[attnscope.Stage.WEIGHTS], tr["weights"])
    assert "masked_scores" in tr and "output" not in tr
    with pytest.raises(AttnScopeError, match="output"):
        tr["output"]


def test_trace_tensors_do_not_track_gradients(inputs):
    tr = _traced("self", inputs)
    assert not any(t.requires_grad for t in tr.stages.values())


def test_trace_predicted_shapes_follow_the_rules(inputs):
    tr = _traced("causal-multihead", torch.stack((inputs, inputs)))
    assert tr.predicted_shape("queries") == (2, 2, 6, 2)
    assert tr.predicted_shape("weights") == (2, 2, 6, 6)
    assert tr.predicted_shape("output") == (2, 6, 4)


def test_str_of_a_trace_is_its_text_rendering(inputs):
    text = str(_traced("self", inputs))
    assert "scaled_scores" in text and "(6, 6)" in text and "\x1b[" not in text


def test_trace_of_v2_records_its_linear_projections(inputs):
    torch.manual_seed(789)
    module = SelfAttentionV2(3, 2)
    tr = module.trace(inputs)
    assert torch.allclose(tr["queries"], module.W_query(inputs).detach())


def test_result_is_what_the_module_returned(inputs):
    """``output`` for multi-head (``tr["output"]`` too), ``context`` otherwise (where
    ``tr["output"]`` is not a stage)."""
    causal, heads = _traced("causal", inputs), _traced("causal-multihead", inputs)
    assert causal.result is causal["context"] and heads.result is heads["output"]


@pytest.mark.parametrize("kind", ["causal", "causal-multihead"])
def test_trace_runs_a_module_with_dropout_in_eval_mode_and_restores_its_mode(inputs, kind):
    torch.manual_seed(0)
    if kind == "causal":
        module = CausalAttention(3, 4, 6, dropout=0.5)
    else:
        module = MultiHeadAttention(3, 4, 6, 0.5, num_heads=2, use_fast_path=False)
    module.train()
    module.dropout.eval()  # a mixed state: each submodule gets its own mode back
    tr = module.trace(inputs)
    assert module.training and not module.dropout.training
    assert module.W_query.training
    with torch.no_grad():
        assert torch.allclose(tr.result, module.eval()(inputs), atol=1e-6)
    module.train()
    tr = module.trace(inputs)
    assert module.training and module.dropout.training
    # weights and context belong to one computation: the walk from weights matches
    assert all(tr.walk(t).matches for t in range(6))
    assert torch.allclose(tr["weights"] @ tr["values"], tr["context"], atol=1e-6)


def test_walk_allows_for_rounding_on_large_inputs_but_not_for_a_wrong_row():
    """Scores in the hundreds magnify float32 rounding in the softmax: here (on x86 with
    the CPU wheel) token 4's context differs from its batched row by more than rtol=1e-5,
    by rounding alone. The walk still matches its own row, and not another row."""
    x = torch.randn(7, 107, generator=torch.Generator().manual_seed(58)) * 18
    torch.manual_seed(123)
    tr = CausalAttention(107, 2, 7, 0.0).trace(x)
    walk = tr.walk(4)
    assert walk.matches and walk.scores_match
    assert all(tr.walk(t).matches for t in range(7))
    walk.batched_context = tr["context"][3]
    assert not walk.matches


def test_trace_labels_are_made_text(inputs):
    tr = attnscope.trace("simplified", inputs, labels=[10, 11, 12, 13, 14, 15])
    assert tr.labels == ("10", "11", "12", "13", "14", "15")
    with pytest.raises(AttnScopeError, match="list of labels, got str"):
        attnscope.trace("simplified", inputs, labels="abcdef")


def test_a_walk_reads_in_one_line():
    """A notebook or REPL echoes a walk as one line: the query, the shapes, the verdict."""
    torch.manual_seed(123)
    t = attnscope.SelfAttentionV1(3, 2).trace(
        attnscope.book_embeddings(), labels=attnscope.BOOK_TOKENS
    )
    text = repr(t.walk(1))
    assert (
        text.startswith("QueryWalk(token 1 'journey'") and "matches its batched row: True" in text
    )
    assert "\n" not in text
