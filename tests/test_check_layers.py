"""attnscope check on real layers: the book's classes, PyTorch's, Hugging Face's, timm's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnscope
from attnscope import check

ch03 = pytest.importorskip(
    "llms_from_scratch.ch03", reason="llms-from-scratch is not installed (pip install --no-deps)"
)


@pytest.mark.parametrize(
    "cls,kind",
    [
        (ch03.SelfAttention_v1, "self"),
        (ch03.SelfAttention_v2, "self"),
        (ch03.CausalAttention, "causal"),
        (ch03.MultiHeadAttentionWrapper, "causal-multihead"),
        (ch03.MultiHeadAttention, "causal-multihead"),
        (ch03.PyTorchMultiHeadAttention, "causal-multihead"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_book_classes_pass_with_inferred_constructor_and_kind(cls, kind):
    report = check(cls)
    assert report.ok, report.to_text(color=False)
    assert report.kind == kind, report.kind_reason


def test_book_v1_is_checked_unbatched_and_says_so():
    """SelfAttention_v1 uses keys.T, which only works on (tokens, d_in): checked that way."""
    report = check(ch03.SelfAttention_v1)
    assert report.ok
    assert any("accepts only unbatched" in n for n in report.notes)


@pytest.mark.parametrize(
    "cls",
    [
        attnscope.SelfAttentionV1,
        attnscope.SelfAttentionV2,
        attnscope.CausalAttention,
        attnscope.MultiHeadAttention,
    ],
)
def test_attnscope_modules_pass_both_batched_and_unbatched(cls):
    report = check(cls)
    assert report.ok, report.to_text(color=False)
    assert report.notes == []  # both input layouts were accepted and checked


def test_attnscope_multihead_explicit_path_passes():
    def make():
        return attnscope.MultiHeadAttention(10, 12, 9, 0.0, 3, use_fast_path=False)

    assert check(make, kind="causal-multihead").ok


def test_attnscope_noncausal_multihead_is_inferred_as_multihead():
    report = check(lambda: attnscope.MultiHeadAttention(10, 12, 9, 0.0, 3, causal=False))
    assert report.ok and report.kind == "multihead", report.kind_reason


@pytest.mark.parametrize("batch_first", [False, True])
def test_torch_multihead_attention(batch_first):
    """nn.MultiheadAttention: combined in_proj_weight, (q, k, v) call, tokens-first layout."""
    report = check(lambda: nn.MultiheadAttention(12, 3, batch_first=batch_first))
    assert report.ok, report.to_text(color=False)
    assert report.kind == "multihead"


def test_torch_multihead_attention_with_separate_projections():
    report = check(lambda: nn.MultiheadAttention(12, 3, kdim=12, vdim=12, bias=False))
    assert report.ok, report.to_text(color=False)


transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def _gpt2(**config):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    layer_idx = config.pop("layer_idx", 0)
    cfg = GPT2Config(n_embd=48, n_head=4, n_positions=32, **config)
    return lambda: GPT2Attention(cfg, layer_idx=layer_idx)


def test_hf_gpt2_attention_passes_as_causal_multihead():
    """Conv1D weights stored (in, out), one combined c_attn, a causal mask passed the HF way."""
    report = check(_gpt2())
    assert report.ok, report.to_text(color=False)
    assert report.kind == "causal-multihead"


def test_hf_gpt2_without_scaling_is_missing_scale():
    report = check(_gpt2(scale_attn_weights=False))
    assert (report.first_failure.stage.value, report.first_failure.mistake) == (
        "scaled_scores",
        "missing_scale",
    )


def test_hf_gpt2_scaled_by_layer_index_is_wrong_scale_with_the_factor():
    report = check(_gpt2(scale_attn_by_inverse_layer_idx=True, layer_idx=3))
    assert report.first_failure.mistake == "wrong_scale"
    assert "0.07217" in report.first_failure.message  # 1/(sqrt(12) * 4)


def test_hf_bert_self_attention_passes_as_multihead():
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    cfg = BertConfig(hidden_size=48, num_attention_heads=4, intermediate_size=64)
    report = check(lambda: BertSelfAttention(cfg))
    assert report.ok, report.to_text(color=False)
    assert report.kind == "multihead"


def test_timm_vit_attention():
    timm_attention = pytest.importorskip(
        "timm.models.vision_transformer",
        reason="timm is not installed (it needs torchvision, which the CPU torch wheel lacks)",
        exc_type=ImportError,
    )
    report = check(lambda: timm_attention.Attention(48, num_heads=4, qkv_bias=True))
    assert report.ok, report.to_text(color=False)
    assert report.kind == "multihead"


def test_named_weights_by_hand():
    """Weights with names that say nothing: found from the computation, and the user may
    still name them with weights=."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.randn(10, 12))
            self.beta = nn.Parameter(torch.randn(10, 12))
            self.gamma = nn.Parameter(torch.randn(10, 12))

        def forward(self, x):
            q, k, v = x @ self.alpha, x @ self.beta, x @ self.gamma
            return torch.softmax(q @ k.mT / 12**0.5, dim=-1) @ v

    assert check(Odd()).ok
    report = check(Odd(), weights={"query": "alpha", "key": "beta", "value": "gamma"})
    assert report.ok, report.to_text(color=False)


@pytest.mark.parametrize(
    "target,init,kind",
    [
        (
            "transformers.models.gpt2.modeling_gpt2:GPT2Attention",
            {"n_embd": 24, "n_head": 3, "n_positions": 32},
            "causal-multihead",
        ),
        (
            "transformers.models.bert.modeling_bert:BertSelfAttention",
            {"hidden_size": 24, "num_attention_heads": 4},
            "multihead",
        ),
    ],
)
def test_hugging_face_layer_built_from_its_config_class(target, init, kind):
    """A layer whose constructor takes a config is built from the config class's defaults,
    --init giving the config's fields; nothing is downloaded."""
    report = check(target, init=init)
    assert report.ok, report.to_text(color=False)
    assert report.kind == kind
    assert report.structure["heads"] == (3 if "gpt2" in target else 4)
