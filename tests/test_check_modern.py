"""attnscope check on real modern attention layers, built from configs with random weights
and called the way their models call them: structure read from the computation, a
correct layer passes, and a bug slipped into the real code is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnscope import AttnScopeError, GroupedQueryAttention, check

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def _hf(module_name: str, layer: str, config: str, **cfg):
    mod = pytest.importorskip(f"transformers.models.{module_name}.modeling_{module_name}")
    config_cls = getattr(transformers, config)
    base = dict(hidden_size=64, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1)
    return getattr(mod, layer), config_cls(**(base | cfg))


def _uneven_norms(m: nn.Module) -> nn.Module:
    """QK norm gains as a trained checkpoint has them (not all ones)."""
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):
            getattr(m, name).weight.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_llama_attention_with_grouped_heads(impl):
    cls, cfg = _hf("llama", "LlamaAttention", "LlamaConfig", num_key_value_heads=2)
    cfg._attn_implementation = impl
    report = check(lambda: cls(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert report.kind == "causal-multihead"
    s = report.structure
    assert (s["heads"], s["kv_heads"], s["head_dim"]) == (4, 2, 16)
    assert s["rope"] == {"pairing": "half", "fraction": 1.0, "base": 10000.0}


def test_hf_mistral_attention_holds_its_sliding_window():
    cls, cfg = _hf("mistral", "MistralAttention", "MistralConfig", num_key_value_heads=2)
    cfg.sliding_window = 3
    report = check(lambda: cls(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert report.structure["window"] == 3


def test_hf_qwen3_attention_reads_its_qk_norm():
    cls, cfg = _hf("qwen3", "Qwen3Attention", "Qwen3Config", num_key_value_heads=2, head_dim=16)
    report = check(lambda: _uneven_norms(cls(cfg, layer_idx=0)))
    assert report.ok, report.to_text(color=False)
    assert report.structure["qk_norm"] == "per-head"


def test_hf_gpt_neox_attention_rotates_a_quarter_of_each_head():
    cls, cfg = _hf("gpt_neox", "GPTNeoXAttention", "GPTNeoXConfig", rotary_pct=0.25)
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert report.structure["rope"]["fraction"] == 0.25


@pytest.mark.parametrize("multi_query,new_arch,kv", [(True, False, 1), (False, True, 2)])
def test_hf_falcon_attention_multi_query_and_grouped(multi_query, new_arch, kv):
    cls, cfg = _hf(
        "falcon",
        "FalconAttention",
        "FalconConfig",
        multi_query=multi_query,
        new_decoder_architecture=new_arch,
        num_kv_heads=2,
        alibi=False,
    )
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert report.structure["kv_heads"] == kv


@pytest.mark.parametrize("heads", [4, 6])
def test_hf_bloom_attention_reads_alibi(heads):
    """BLOOM's ALiBi (6 heads: not a power of two), given the causal mask its model passes."""
    cls, cfg = _hf("bloom", "BloomAttention", "BloomConfig", n_head=heads, hidden_size=48)
    report = check(lambda: cls(cfg, layer_idx=0), kind="causal-multihead")
    assert report.ok, report.to_text(color=False)
    assert report.structure["bias"] == "alibi"


def test_a_bug_slipped_into_hf_llama_is_named(monkeypatch):
    """Key/value heads tiled (repeat) instead of interleaved inside the real layer."""
    from transformers.models.llama import modeling_llama

    def tiled(hidden, n_rep):
        return hidden if n_rep == 1 else hidden.repeat(1, n_rep, 1, 1)

    monkeypatch.setattr(modeling_llama, "repeat_kv", tiled)
    cls, cfg = _hf("llama", "LlamaAttention", "LlamaConfig", num_key_value_heads=2)
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=0))
    assert not report.ok
    assert (report.first_failure.stage.value, report.first_failure.mistake) == (
        "scores",
        "kv_group_mapping",
    )


def test_rotate_half_of_the_wrong_pairing_in_hf_llama_is_named(monkeypatch):
    """Interleaved rotation against Hugging Face's half-laid-out tables: not a rotation."""
    from transformers.models.llama import modeling_llama

    def interleaved(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    monkeypatch.setattr(modeling_llama, "rotate_half", interleaved)
    cls, cfg = _hf("llama", "LlamaAttention", "LlamaConfig", num_key_value_heads=2)
    report = check(lambda: cls(cfg, layer_idx=0))
    assert not report.ok
    assert report.first_failure.mistake == "rope_pairing"


# --- the book's own modern layers, in a block that supplies what their model does -------------


@pytest.fixture(scope="module")
def llama3():
    """The book's Llama 3 code (it imports tiktoken, a test dependency)."""
    return pytest.importorskip("llms_from_scratch.llama3", reason="llms-from-scratch not installed")


@pytest.fixture(scope="module")
def qwen3():
    """The book's Qwen 3 code (it imports tiktoken, a test dependency)."""
    return pytest.importorskip("llms_from_scratch.qwen3", reason="llms-from-scratch not installed")


class _BookBlock(nn.Module):
    """What the book's model does around its attention: RoPE tables and the causal mask."""

    def __init__(self, att: nn.Module, head_dim: int, rope):
        super().__init__()
        self.att = att
        cos, sin = rope.compute_rope_params(head_dim, context_length=64)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        return self.att(x, mask, self.cos, self.sin)


def test_the_books_llama3_grouped_query_attention(llama3):
    report = check(lambda: _BookBlock(llama3.GroupedQueryAttention(64, 64, 8, 2), 8, llama3))
    assert report.ok, report.to_text(color=False)
    assert report.layer == "att"
    assert (report.structure["heads"], report.structure["kv_heads"]) == (8, 2)


def test_the_books_qwen3_grouped_query_attention_with_qk_norm(qwen3):
    def make():
        att = qwen3.GroupedQueryAttention(48, 4, 2, head_dim=16, qk_norm=True)
        with torch.no_grad():
            att.q_norm.scale.uniform_(0.5, 1.5)
            att.k_norm.scale.uniform_(0.5, 1.5)
        return _BookBlock(att, 16, qwen3)

    report = check(make)
    assert report.ok, report.to_text(color=False)
    assert report.structure["qk_norm"] == "per-head"
    assert report.structure["head_dim"] == 16


@pytest.mark.parametrize("fast", [True, False])
def test_attnscopes_own_grouped_layer_passes_on_both_paths(fast):
    layer = GroupedQueryAttention(32, 32, 4, 2, qk_norm="per-head", window=3)
    with torch.no_grad():
        layer.q_norm.weight.uniform_(0.5, 1.5)
    layer.use_fast_path = fast
    report = check(lambda: layer)
    assert report.ok, report.to_text(color=False)
    s = report.structure
    assert (s["kv_heads"], s["qk_norm"], s["window"], s["rope"]["pairing"]) == (
        2,
        "per-head",
        3,
        "half",
    )


def test_a_turn_that_is_no_rotation_is_refused_not_judged():
    class Gain(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.register_buffer("g", torch.linspace(0.5, 1.5, 64)[:, None])

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            n = x.shape[1]
            q = q * self.g[:n]  # position-dependent, not a rotation
            w = (q @ k.transpose(1, 2) / 4).softmax(-1)
            return w @ v

    with pytest.raises(AttnScopeError, match="not supported yet"):
        check(Gain)


OWN = {
    "mqa": dict(num_kv_heads=1),
    "interleaved": dict(num_kv_heads=2, rope_pairing="interleaved"),
    "partial": dict(rope_fraction=0.5, rope_base=500_000.0),
    # base 1e8: the last pairs turn 1e-7 a position and pass for unrotated features
    "slow-base": dict(d_out=64, num_kv_heads=2, rope_base=1e8),
    "slow-base-interleaved": dict(d_out=64, rope_base=1e8, rope_pairing="interleaved"),
    "qk-norm-full": dict(num_kv_heads=2, qk_norm="full"),
    "alibi-bidirectional": dict(alibi=True, causal=False),
    "cross": dict(cross=True, num_kv_heads=2),
}


@pytest.mark.parametrize("name", OWN)
def test_every_variant_of_attnscopes_own_layer_passes_with_its_structure(name):
    """The library's modern layer and the checker agree: each variant passes, read as built."""
    kw = dict(OWN[name])
    layer = GroupedQueryAttention(32, kw.pop("d_out", 32), 4, **kw)
    if layer.qk_norm:
        with torch.no_grad():
            layer.q_norm.weight.uniform_(0.5, 1.5)
            layer.k_norm.weight.uniform_(0.5, 1.5)
    report = check(lambda: layer)
    assert report.ok, report.to_text(color=False)
    s = report.structure
    assert s["kv_heads"] == layer.num_kv_heads
    assert s["cross"] is layer.cross and report.kind == layer.kind
    assert (s["rope"] is not None) == layer.rope
    assert s["qk_norm"] == layer.qk_norm
    assert s["bias"] == ("alibi" if layer.alibi else None)
    if layer.rope:
        assert s["rope"]["pairing"] == layer.rope_pairing
        assert s["rope"]["fraction"] == layer.rope_fraction
        assert s["rope"]["base"] == pytest.approx(layer.rope_base, rel=1e-2)


def test_hf_gemma2_attention_scales_by_its_query_pre_attn_scalar():
    """Gemma 2 declares its scale (query_pre_attn_scalar, here not the head size): correct."""
    cls, cfg = _hf(
        "gemma2",
        "Gemma2Attention",
        "Gemma2Config",
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=None,
        num_hidden_layers=2,
    )
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=1))  # a full-attention layer
    assert report.ok, report.to_text(color=False)


@pytest.mark.parametrize("multi_query", [True, False])
def test_hf_gpt_bigcode_block_gets_the_models_causal_mask(multi_query):
    """An HF block around an attention that takes its causal mask from the model: the block
    is handed that mask, and passes it on (no missing_mask on correct code)."""
    mod = pytest.importorskip("transformers.models.gpt_bigcode.modeling_gpt_bigcode")
    cfg = transformers.GPTBigCodeConfig(n_embd=48, n_head=4, n_layer=1, multi_query=multi_query)
    cfg._attn_implementation = "eager"
    report = check(lambda: mod.GPTBigCodeBlock(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert (report.kind, report.layer) == ("causal-multihead", "attn")
    assert report.structure["kv_heads"] == (1 if multi_query else 4)


def test_hf_siglip_attention_takes_batched_input_only():
    """SiglipAttention's (tokens, d) input runs and means something else (its heads are
    split with transpose(1, 2)): set aside, the batched calls are judged, correct."""
    mod = pytest.importorskip("transformers.models.siglip.modeling_siglip")
    cfg = transformers.SiglipVisionConfig(
        hidden_size=48, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1
    )
    cfg._attn_implementation = "eager"
    report = check(lambda: mod.SiglipAttention(cfg))
    assert report.ok, report.to_text(color=False)
    assert any("accepts only batched" in n for n in report.notes)


def test_hf_llama_with_yarn_rope_scaling_carries_its_attention_factor():
    """YaRN's rotary class folds an attention factor into cos and sin (both sides): the
    scores grow by its square, by design; no wrong_scale on correct code."""
    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    try:
        cls, cfg = _hf(
            "llama", "LlamaAttention", "LlamaConfig", num_key_value_heads=2, rope_parameters=rope
        )
    except (TypeError, ValueError):  # older transformers: rope_scaling
        cls, cfg = _hf(
            "llama", "LlamaAttention", "LlamaConfig", num_key_value_heads=2, rope_scaling=rope
        )
    cfg.max_position_embeddings = 256
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert report.structure["rope"]["pairing"] == "half"


def test_hf_phi_decoder_layer_keeps_its_config_in_its_attention():
    """The model's rotary class is built from the config the attention holds (Phi's
    decoder layer has none of its own); parallel attention and MLP, QK LayerNorm."""
    mod = pytest.importorskip("transformers.models.phi.modeling_phi")
    cfg = transformers.PhiConfig(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=1,
        partial_rotary_factor=0.5,
        qk_layernorm=True,
    )
    cfg._attn_implementation = "eager"
    report = check(lambda: mod.PhiDecoderLayer(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert report.layer == "self_attn"
    assert report.structure["rope"]["fraction"] == 0.5


def test_hf_gemma3_decoder_layer_asks_its_rotary_for_its_layer_type():
    cls, cfg = _hf(
        "gemma3",
        "Gemma3DecoderLayer",
        "Gemma3TextConfig",
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
    )
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert (report.structure["window"], report.structure["qk_norm"]) == (4, "per-head")


@pytest.mark.parametrize("cap", [50.0, 5.0])
def test_hf_gemma2_attention_with_its_logit_softcapping(cap):
    """Gemma 2 declares attn_logit_softcapping and applies cap * tanh(scores / cap): held
    to it (a small cap read as wrong_scale or not_dot_product before)."""
    cls, cfg = _hf(
        "gemma2",
        "Gemma2Attention",
        "Gemma2Config",
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=cap,
        num_hidden_layers=2,
    )
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=1))
    assert report.ok, report.to_text(color=False)
    assert any("soft-capping" in n for n in report.notes)


def test_hf_gpt_oss_attention_sinks_are_refused_not_judged():
    """A learned logit per head joined to the scores before the softmax (GPT-OSS): not
    textbook attention, not modelled; exit 2 naming it (not_softmax on it before)."""
    mod = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    cfg = transformers.GptOssConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    cfg._attn_implementation = "eager"

    def make():
        layer = mod.GptOssAttention(cfg, layer_idx=1)
        with torch.no_grad():
            layer.sinks.normal_()
        return layer

    with pytest.raises(AttnScopeError, match="attention sink"):
        check(make)


def test_hf_llama4_text_attention_takes_one_complex_table():
    """Llama 4's rotary class returns one complex freqs_cis, not (cos, sin): handed as the
    model hands it (the check could not be completed before); its L2 QK norm is read."""
    cls, cfg = _hf(
        "llama4",
        "Llama4TextAttention",
        "Llama4TextConfig",
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
    )
    cfg._attn_implementation = "eager"
    report = check(lambda: cls(cfg, layer_idx=0))
    assert report.ok, report.to_text(color=False)
    assert report.structure["rope"]["pairing"] == "interleaved"
