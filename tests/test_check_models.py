"""attnscope check on whole models: every attention layer found by what it computes, each
checked where it sits (on the masks and positions the model gives it), in run order."""

from __future__ import annotations

import json
import math
import types

import jsonschema
import pytest
import torch
from conftest import ROOT

from attnscope import AttnScopeError, ModelReport, check
from attnscope.cli import main
from attnscope.testing import AttentionMismatch, assert_attention

ch04 = pytest.importorskip("llms_from_scratch.ch04", reason="llms-from-scratch not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

GPT = {
    "vocab_size": 100,
    "context_length": 16,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 3,
    "drop_rate": 0.0,
    "qkv_bias": False,
}


def _book_gpt():
    torch.manual_seed(0)
    return ch04.GPTModel(GPT)


def _keys_from_w_query(self, x):
    """The book's MultiHeadAttention forward with one slip: keys made with W_query."""
    b, n, _ = x.shape
    q, k, v = self.W_query(x), self.W_query(x), self.W_value(x)
    q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
    w = torch.softmax(s / k.shape[-1] ** 0.5, dim=-1)
    return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, self.d_out))


def _book_gpt_with_a_bug_in_layer_1():
    model = _book_gpt()
    att = model.trf_blocks[1].att
    att.forward = types.MethodType(_keys_from_w_query, att)
    return model


def test_the_books_gpt_model_is_checked_layer_by_layer():
    report = check(_book_gpt)
    assert isinstance(report, ModelReport) and report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == [f"trf_blocks.{i}.att" for i in range(3)]
    assert all(r.kind == "causal-multihead" for _, r in report.layers)


def test_a_bug_in_one_layer_that_is_not_the_first_is_named_with_its_layer():
    report = check(_book_gpt_with_a_bug_in_layer_1)
    assert not report.ok
    assert report.first_layer == "trf_blocks.1.att"
    assert (report.first_failure.stage.value, report.first_failure.mistake) == (
        "keys",
        "wrong_projection",
    )
    assert [r.ok for _, r in report.layers] == [True, False, True]
    text = report.to_text(color=False)
    assert "first failing layer: trf_blocks.1.att" in text and "wrong_projection" in text


def _explicit(softmax_dim: int = -1):
    """The book's MultiHeadAttention forward written out, its softmax over ``softmax_dim``."""

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        w = torch.softmax(s / k.shape[-1] ** 0.5, dim=softmax_dim)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, self.d_out))

    return forward


def _fused(self, x):
    """The same layer with the core in one scaled_dot_product_attention call."""
    b, n, _ = x.shape
    q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
    q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.out_proj(ctx.transpose(1, 2).reshape(b, n, self.d_out))


@pytest.mark.parametrize("slip", [False, True])
def test_explicit_layers_after_a_fused_one_are_found(slip):
    """Layer 0 calls scaled_dot_product_attention, layers 1 and 2 spell the products out:
    every layer is found (a fused call's output is a context, from which the next layer's
    scores are made), and a softmax over the queries in layer 2 is named there, never
    passed over as a model with one layer fewer."""
    model = _book_gpt()
    forwards = [_fused, _explicit(), _explicit(-2 if slip else -1)]
    for block, forward in zip(model.trf_blocks, forwards, strict=True):
        block.att.forward = types.MethodType(forward, block.att)
    report = check(lambda: model)
    assert [p for p, _ in report.layers] == [f"trf_blocks.{i}.att" for i in range(3)]
    if not slip:
        assert report.ok, report.to_text(color=False)
    else:
        failure = report.first_failure
        assert (report.first_layer, failure.stage.value, failure.mistake) == (
            "trf_blocks.2.att",
            "weights",
            "softmax_wrong_dim",
        )


@pytest.mark.parametrize("dropped", [False, True])
def test_an_alibi_bias_the_model_hands_a_layer_that_ignores_it_is_bias_missing(dropped):
    """Hugging Face MPT builds ALiBi once and hands it to every layer (``position_bias``,
    a bias of the key alone): a layer that does not add it is named ``bias_missing``,
    not passed as a layer without a bias; the model as built passes."""

    def make():
        torch.manual_seed(0)
        cfg = transformers.MptConfig(
            vocab_size=100, d_model=32, n_heads=4, n_layers=3, expansion_ratio=2, max_seq_len=64
        )
        model = transformers.MptModel(cfg).eval()
        if dropped:
            att = model.blocks[1].attn
            forward = att.forward

            def without_bias(self, hidden_states, position_bias, *args, **kwargs):
                return forward(hidden_states, torch.zeros_like(position_bias), *args, **kwargs)

            att.forward = types.MethodType(without_bias, att)
        return model

    report = check(make)
    assert [p for p, _ in report.layers] == [f"blocks.{i}.attn" for i in range(3)]
    if not dropped:
        assert report.ok, report.to_text(color=False)
        assert all(r.structure["bias"] == "alibi" for _, r in report.layers)
        return
    failure = report.first_failure
    assert (report.first_layer, failure.stage.value, failure.mistake) == (
        "blocks.1.attn",
        "biased_scores",
        "bias_missing",
    )


class _NeedsSetup(torch.nn.Module):
    """gpt-fast's shape: ``setup_caches()`` makes the tables and caches every call needs."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.freqs = None

    def setup_caches(self, max_batch_size, max_seq_length):
        self.freqs = torch.ones(max_seq_length)

    def forward(self, idx, input_pos=None):
        assert self.freqs is not None, "Caches must be initialized first"
        return self.emb(idx)


def test_a_model_that_must_be_set_up_first_is_refused_saying_so():
    with pytest.raises(AttnScopeError, match=r"not supported yet: .*setup_caches\(\)"):
        check(_NeedsSetup)


def test_the_model_report_follows_the_contract(report_schema):
    data = check(_book_gpt_with_a_bug_in_layer_1).to_dict()
    jsonschema.validate(data, report_schema)
    assert data["kind"] == "model" and data["first_failure"]["layer"] == "trf_blocks.1.att"
    assert [entry["layer"] for entry in data["layers"]] == [f"trf_blocks.{i}.att" for i in range(3)]


@pytest.mark.parametrize(
    "config,model,kv",
    [
        ("GPT2Config", "GPT2Model", 4),
        ("LlamaConfig", "LlamaModel", 2),
        ("MistralConfig", "MistralModel", 2),
        ("Qwen3Config", "Qwen3Model", 2),
        ("GPTNeoXConfig", "GPTNeoXModel", 4),
    ],
)
def test_hugging_face_models_from_configs(config, model, kv):
    """Run through their standard forward on token ids; every layer on its real inputs."""
    sizes = dict(vocab_size=100, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    sizes |= dict(num_attention_heads=4, num_key_value_heads=2)
    if config == "GPT2Config":
        sizes = dict(vocab_size=100, n_layer=2, n_embd=32, n_head=4, n_positions=32)
    cfg = getattr(transformers, config)(**sizes)
    report = check(lambda: getattr(transformers, model)(cfg))
    assert report.ok, report.to_text(color=False)
    assert len(report.layers) == 2
    assert all(r.structure["kv_heads"] == kv for _, r in report.layers)


def _hf_model(config: str, model: str, **sizes):
    base = dict(vocab_size=100, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    base |= dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=None)
    cfg = getattr(transformers, config)(**(base | sizes))

    def make():
        torch.manual_seed(0)
        return getattr(transformers, model)(cfg).eval()

    return make


def test_a_residual_the_model_hands_its_layer_is_not_the_layers_output():
    """BLOOM's attention takes the block's ``residual`` and returns ``dense(context) +
    residual``: read from what it computes, the residual is handed as zeros (it had been
    output/other on every layer)."""
    report = check(_hf_model("BloomConfig", "BloomModel", n_head=4))
    assert report.ok, report.to_text(color=False)
    assert all(r.structure["bias"] == "alibi" for _, r in report.layers)
    assert any("residual" in n for n in report.layers[0][1].notes)


def test_a_full_layer_that_holds_the_models_window_and_says_it_is_not_sliding_passes():
    """EXAONE 4 keeps ``sliding_window`` on every layer and ``is_sliding`` False on its
    full ones: the window is not theirs (a false alarm, window_missing)."""
    make = _hf_model(
        "Exaone4Config",
        "Exaone4Model",
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )
    report = check(make)
    assert report.ok, report.to_text(color=False)
    windows = [r.structure["window"] for _, r in report.layers]
    assert windows == [3, None]


def test_an_attention_that_adds_its_input_and_norms_the_sum_is_checked_up_to_its_projection():
    """ALBERT's attention module applies its dense output projection, adds the hidden states
    and norms the sum: read from the computation, its output is taken at the projection (it
    had been output/other); its one layer, shared by every depth, is checked once."""
    make = _hf_model("AlbertConfig", "AlbertModel", embedding_size=16)
    report = check(make)
    assert report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == [
        "encoder.albert_layer_groups.0.albert_layers.0.attention"
    ]


@pytest.mark.parametrize(
    "config,model,words",
    [
        # (MPNet's relative bias handed to each layer is a learned one since round 38:
        # checked in tests/test_check_r38_reading.py)
        ("NystromformerConfig", "NystromformerModel", "convolution over the tokens"),
    ],
)
def test_hugging_face_encoders_with_what_the_reference_lacks_are_refused(config, model, words):
    with pytest.raises(AttnScopeError, match="not supported yet") as info:
        check(_hf_model(config, model))
    assert words in str(info.value)


def _weights_not_normalised(self, x):
    """The book's MultiHeadAttention forward with its softmax dropped: masked scores, scaled,
    multiply the values as they are."""
    b, n, _ = x.shape
    q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
    q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], 0.0)
    w = s * k.shape[-1] ** -0.5  # (a product: nothing on the way normalises)
    return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, self.d_out))


def test_a_layer_that_dropped_its_softmax_is_still_found_beside_its_siblings():
    """Nothing normalises its scores, but a layer of its class does: an attention layer
    with a slip, not a state-space mixer."""

    def make():
        model = _book_gpt()
        att = model.trf_blocks[1].att
        att.forward = types.MethodType(_weights_not_normalised, att)
        return model

    report = check(make, decode="none")
    assert [p for p, _ in report.layers] == [f"trf_blocks.{i}.att" for i in range(3)]
    failure = report.first_failure
    assert (report.first_layer, failure.stage.value, failure.mistake) == (
        "trf_blocks.1.att",
        "weights",
        "not_softmax",
    ), report.to_text(color=False)


def test_a_state_space_mixer_beside_attention_is_not_taken_for_attention():
    """Jamba's Mamba layers compute C B^T times decays, a token-mixing product with no
    softmax: not attention layers (they had been found, then refused)."""
    make = _hf_model(
        "JambaConfig",
        "JambaModel",
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    )
    report = check(make)
    assert [p for p, _ in report.layers] == ["layers.1.self_attn", "layers.3.self_attn"]
    assert report.ok, report.to_text(color=False)


@pytest.mark.parametrize("name", ["Bert", "DistilBert"])
def test_hugging_face_encoders_are_checked_as_bidirectional(name):
    if name == "Bert":
        sizes = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
        sizes |= dict(intermediate_size=64)
    else:  # its layers take the hidden states three times: query=, key=, value=
        sizes = dict(dim=32, n_heads=4, n_layers=2, hidden_dim=64)
    cfg = getattr(transformers, f"{name}Config")(vocab_size=100, **sizes)
    report = check(lambda: getattr(transformers, f"{name}Model")(cfg))
    assert report.ok, report.to_text(color=False)
    assert all(r.kind == "multihead" for _, r in report.layers)


def test_cli_on_a_model_exits_1_and_writes_every_layer(tmp_path, capsys):
    target = f"{ROOT / 'tests' / 'test_check_models.py'}:_book_gpt_with_a_bug_in_layer_1"
    html = tmp_path / "model.html"
    assert main(["check", target, "--html", str(html)]) == 1
    out = capsys.readouterr().out
    assert all(f"trf_blocks.{i}.att" in out for i in range(3))
    page = html.read_text()
    assert "First failing layer" in page and "trf_blocks.1.att" in page
    assert main(["check", target, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["kind"] == "model"


def test_assert_attention_holds_every_layer_of_a_model():
    assert assert_attention(_book_gpt).ok
    with pytest.raises(AttentionMismatch, match="trf_blocks.1.att"):
        assert_attention(_book_gpt_with_a_bug_in_layer_1)


def test_a_hugging_face_model_class_is_built_small_from_its_config_defaults():
    """LlamaConfig's defaults are a 7B model: built small, and the report says so."""
    report = check("transformers.models.llama.modeling_llama:LlamaModel")
    assert report.ok and len(report.layers) == 2
    assert any("made small" in n and "--init" in n for n in report.notes)


def test_decode_asked_of_a_bidirectional_model_is_refused():
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
    )
    with pytest.raises(AttnScopeError, match="--decode hf: expected"):
        check(lambda: transformers.BertModel(cfg), decode="hf")
    report = check(lambda: transformers.BertModel(cfg), decode="none")
    assert report.ok and report.decode is None


def _context_einsum_slip(self, x):
    """The book's layer with its weighted sum written ``bhqk,bhqd->bhqd``: the keys' axis
    summed away on the weights alone, each query's own value returned."""
    b, n, _ = x.shape
    q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
    q, k, v = (t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
    w = torch.softmax(s / k.shape[-1] ** 0.5, dim=-1)
    ctx = torch.einsum("bhqk,bhqd->bhqd", w, v)
    return self.out_proj(ctx.transpose(1, 2).reshape(b, n, self.d_out))


def test_a_layer_whose_context_einsum_contracts_nothing_is_found_and_named():
    """A weighted sum that contracts no axis the weights and values share is still the
    layer's context product: the layer is found (not checked as a model without it) and
    its slip named."""
    model = _book_gpt()
    att = model.trf_blocks[2].att
    att.forward = types.MethodType(_context_einsum_slip, att)
    report = check(lambda: model)
    assert [p for p, _ in report.layers] == [f"trf_blocks.{i}.att" for i in range(3)]
    failure = report.first_failure
    assert (report.first_layer, failure.stage.value, failure.mistake) == (
        "trf_blocks.2.att",
        "context",
        "context_wrong_product",
    )


class _TokensFirstGPT(torch.nn.Module):
    """A model that runs its layers on tokens-first hidden states ``(T, B, d)`` (EleutherAI's
    gpt-neox, Megatron): each layer an ``nn.MultiheadAttention`` (batch_first=False) with a
    causal mask."""

    def __init__(self, vocab=50, d=32, heads=4, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.MultiheadAttention(d, heads, bias=False) for _ in range(layers)
        )
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        n = ids.shape[1]
        h = self.emb(ids).transpose(0, 1)  # (T, B, d)
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        for layer in self.layers:
            h = h + layer(h, h, h, attn_mask=mask, need_weights=False)[0]
        return self.head(h.transpose(0, 1))


def test_a_model_whose_layers_take_tokens_first_hidden_states_is_checked():
    """The probe enters a layer transposed to its layout; recorded only inside the layer,
    the transposed probe is the input it reads (it was untraced: no attention found)."""

    def make():
        torch.manual_seed(0)
        return _TokensFirstGPT().eval()

    report = check(make)
    assert report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["layers.0", "layers.1"]
    assert all(r.kind == "causal-multihead" for _, r in report.layers)


@pytest.mark.parametrize("batch_first", [True, False])
def test_pytorchs_own_transformer_encoder_is_checked_layer_by_layer(batch_first):
    """nn.TransformerEncoder: one nn.MultiheadAttention a layer, each found by its
    multi_head_attention_forward call and checked where it sits."""

    def make():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first)
        return torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False).eval()

    report = check(make)
    assert isinstance(report, ModelReport) and report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == [f"layers.{i}.self_attn" for i in range(3)]
    assert all(r.kind == "multihead" for _, r in report.layers)


class _Stacks(torch.nn.Module):
    """Two stacks of one layer class (``nn.MultiheadAttention``): an encoder's, never
    masked, and a decoder's, masked where ``masked`` says (x-transformers' build loop that
    pops ``causal`` leaves all but its first layer without the mask)."""

    def __init__(self, masked=(True, True), vocab=50, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.masked = masked
        self.emb = torch.nn.Embedding(vocab, d)
        mha = lambda: torch.nn.MultiheadAttention(d, heads, batch_first=True)  # noqa: E731
        self.encoder = torch.nn.ModuleList(mha() for _ in range(2))
        self.decoder = torch.nn.ModuleList(mha() for _ in masked)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        n = ids.shape[1]
        e = h = self.emb(ids)
        for layer in self.encoder:
            e = e + layer(e, e, e, need_weights=False)[0]
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        for layer, masked in zip(self.decoder, self.masked, strict=True):
            h = h + layer(h, h, h, attn_mask=future if masked else None, need_weights=False)[0]
        return self.head(h + e)


def test_a_stack_of_one_layer_class_is_one_kind_when_the_kind_is_inferred():
    """The decoder's later layers built without the mask its first one has are checked as
    the decoder layers they are (missing_mask); the encoder's stack, unmasked throughout,
    stays an encoder."""
    report = check(lambda: _Stacks((True, False)).eval())
    kinds = {p: r.kind for p, r in report.layers}
    assert kinds == {
        "encoder.0": "multihead",
        "encoder.1": "multihead",
        "decoder.0": "causal-multihead",
        "decoder.1": "causal-multihead",
    }
    assert "its stack" in dict(report.layers)["decoder.1"].kind_reason
    failure = report.first_failure
    assert (report.first_layer, failure.stage.value, failure.mistake) == (
        "decoder.1",
        "masked_scores",
        "missing_mask",
    )
    assert check(lambda: _Stacks((True, True)).eval()).ok


class _Core(torch.nn.Module):
    """An attention core without weights, handed queries, keys and values per head."""

    def forward(self, q, k, v, mask):
        s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        return s.masked_fill(mask, float("-inf")).softmax(-1) @ v


class _SelfAttention(torch.nn.Module):
    """ChatGLM's split: the projections here, the products in a core submodule."""

    def __init__(self, d, heads, tokens_first):
        super().__init__()
        self.h, self.tokens_first = heads, tokens_first
        self.query_key_value = torch.nn.Linear(d, 3 * d)
        self.core_attention = _Core()
        self.dense = torch.nn.Linear(d, d)

    def forward(self, x, mask):
        if self.tokens_first:
            x = x.transpose(0, 1)
        b, n, d = x.shape
        q, k, v = self.query_key_value(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        y = self.dense(self.core_attention(q, k, v, mask).transpose(1, 2).reshape(b, n, d))
        return y.transpose(0, 1) if self.tokens_first else y


class _CoreInside(torch.nn.Module):
    def __init__(self, tokens_first, vocab=50, d=32, heads=4, layers=2):
        super().__init__()
        self.tokens_first = tokens_first
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            _SelfAttention(d, heads, tokens_first) for _ in range(layers)
        )
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        n = ids.shape[1]
        h = self.emb(ids)
        h = h.transpose(0, 1) if self.tokens_first else h
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        for layer in self.layers:
            h = h + layer(h, mask)
        return self.head(h.transpose(0, 1) if self.tokens_first else h)


@pytest.mark.parametrize("tokens_first", [False, True])
def test_a_layer_is_the_module_holding_its_projections_not_its_weightless_core(tokens_first):
    """The projections are found at the model level too (its parameters named in the
    record), so the layer is the module that makes queries, keys and values and calls a
    core with them, not the core, which takes no hidden states (ChatGLM's core_attention)."""

    def make():
        torch.manual_seed(0)
        return _CoreInside(tokens_first).eval()

    report = check(make)
    assert report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["layers.0", "layers.1"]
    assert all(r.kind == "causal-multihead" for _, r in report.layers)


class _StaticCacheAttention(torch.nn.Module):
    """gemma_pytorch's layer: rotary keys and values written with index_copy_ into the static
    cache it is handed, at the tokens' positions, the scores read over every slot, the mask
    hiding those not written."""

    def __init__(self, d=32, heads=4, slip=False):
        super().__init__()
        self.h, self.hd, self.slip = heads, d // heads, slip
        self.qkv_proj = torch.nn.Linear(d, 3 * d, bias=False)
        self.o_proj = torch.nn.Linear(d, d, bias=False)

    def forward(self, x, pos, kv_cache, mask):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.h, self.hd) for t in self.qkv_proj(x).split(d, -1))
        half = self.hd // 2
        inv = 1.0 / 10000 ** (torch.arange(half, dtype=x.dtype) / half)
        ang = pos.to(x.dtype)[:, None, None] * inv
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        turn = (q,) if self.slip else (q, k)  # the slip: keys written unrotated
        turned = [t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin for t in turn]
        q, k = (*turned, k) if self.slip else turned
        k_cache, v_cache = kv_cache
        k_cache[:b].index_copy_(1, pos, k)
        v_cache[:b].index_copy_(1, pos, v)
        keys, values = k_cache[:b].transpose(1, 2), v_cache[:b].transpose(1, 2)
        s = q.transpose(1, 2) @ keys.transpose(2, 3) / self.hd**0.5 + mask
        y = (s.softmax(-1) @ values).transpose(1, 2).reshape(b, n, d)
        return self.o_proj(y)


class _StaticCacheLM(torch.nn.Module):
    def __init__(self, vocab=50, d=32, heads=4, layers=2, slots=24, slip=False):
        super().__init__()
        self.shape = (8, slots, heads, d // heads)
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            _StaticCacheAttention(d, heads, slip and i == 1) for i in range(layers)
        )
        full = torch.full((slots, slots), float("-inf"))
        self.register_buffer("mask", torch.triu(full, diagonal=1))

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        mask = self.mask.index_select(0, pos)[None, None]
        h = self.emb(ids)
        for layer in self.layers:
            caches = (torch.zeros(self.shape), torch.zeros(self.shape))
            h = h + layer(h, pos, caches, mask)
        return h @ self.emb.weight.t()


@pytest.mark.parametrize("slip", [False, True])
def test_a_static_cache_read_whole_is_read_through_the_slots_it_wrote(slip):
    """gemma_pytorch's static cache: the scores read 24 slots for 7 queries, 17 of them
    unwritten and hidden by the mask; the keys' rotation is read on the slots some query
    sees (m5's 17 was refused), and keys written unrotated in layer 1 are found."""

    def make():
        torch.manual_seed(0)
        return _StaticCacheLM(slip=slip).eval()

    report = check(make, kind="causal-multihead")
    if not slip:
        assert report.ok, report.to_text(color=False)
        assert all(r.structure["rope"]["pairing"] == "half" for _, r in report.layers)
        return
    failure = report.first_failure
    assert (report.first_layer, failure.stage.value, failure.mistake) == (
        "layers.1",
        "rotated_keys",
        "rope_missing",
    ), report.to_text(color=False)


class _BareTable(torch.nn.Module):
    """An embedding held as a bare parameter (TransformerLens' ``W_E``, a TF port's ``wte``)."""

    def __init__(self, rows: int, width: int, how: str):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(rows, width) * 0.5)
        self.how = how

    def forward(self, ids):
        if self.how == "index":
            return self.table[ids, :]
        if self.how == "embedding":
            return torch.nn.functional.embedding(ids, self.table)
        return self.table.index_select(0, ids.flatten()).view(*ids.shape, -1)


class _Positions(torch.nn.Module):
    def __init__(self, rows: int, width: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(rows, width) * 0.1)

    def forward(self, ids):
        return self.table[torch.arange(ids.shape[-1])]


@pytest.mark.parametrize("how", ["index", "embedding", "index_select"])
def test_a_model_whose_embedding_is_a_bare_parameter_takes_token_ids(how):
    """No ``nn.Embedding`` anywhere: the vocabulary is the rows of the table the model's
    first look-up on its input reads (here 100, not the 16 rows of the position table)."""

    def factory():
        model = _book_gpt()
        model.pos_emb = _Positions(GPT["context_length"], GPT["emb_dim"])
        model.tok_emb = _BareTable(GPT["vocab_size"], GPT["emb_dim"], how)
        return model

    from attnscope.checking.model import token_vocabulary

    assert token_vocabulary(factory()) == GPT["vocab_size"]
    report = check(factory)
    assert isinstance(report, ModelReport) and report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == [f"trf_blocks.{i}.att" for i in range(3)]


class _Attn(torch.nn.Module):
    """Plain multi-head attention: queries from ``x``, keys and values from ``xa`` (or ``x``)."""

    def __init__(self, d: int = 32, heads: int = 4, causal: bool = False):
        super().__init__()
        self.h, self.causal = heads, causal
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x, xa=None):
        src = x if xa is None else xa
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.h, -1).transpose(1, 2)
        k = self.k(src).view(b, src.shape[1], self.h, -1).transpose(1, 2)
        v = self.v(src).view(b, src.shape[1], self.h, -1).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / (d // self.h) ** 0.5
        if self.causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _BuiltinSource(torch.nn.Module):
    """Token ids in; a second input built inside (Whisper's audio): a data buffer projected
    by a learned layer, then run through an encoder layer of its own."""

    def __init__(self, cross: bool):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("features", torch.randn(1, 6, 8))
        self.inp = torch.nn.Linear(8, 32)
        self.enc = torch.nn.ModuleList([_Attn()])
        self.emb = torch.nn.Embedding(50, 32)
        self.dec = torch.nn.ModuleList([_Attn(causal=True)])
        self.cross = torch.nn.ModuleList([_Attn()]) if cross else None
        self.head = torch.nn.Linear(32, 50)

    def forward(self, ids):
        a = self.inp(self.features.expand(ids.shape[0], -1, -1))
        for layer in self.enc:
            a = a + layer(a)
        x = self.emb(ids)
        x = x + self.dec[0](x)
        context = a.mean(1, keepdim=True) if self.cross is None else self.cross[0](x, a)
        x = x + context
        return self.head(x)


def test_the_layers_of_an_input_the_model_builds_inside_are_found():
    """A buffer a learned layer projects is data (a second input), not a table: the encoder
    layer that runs on it is an attention layer of the model, found and checked."""
    report = check(lambda: _BuiltinSource(cross=False).eval(), decode="none")
    assert isinstance(report, ModelReport) and report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["enc.0", "dec.0"]
    assert [r.kind for _, r in report.layers] == ["multihead", "causal-multihead"]


def test_cross_attention_inside_a_model_is_checked_where_it_sits():
    """Keys and values read from another sequence the model hands a layer (the encoder's
    output, built here from a buffer): the layer is cross-attention, checked where it sits
    on the sequence the model hands it."""
    report = check(lambda: _BuiltinSource(cross=True).eval(), decode="none")
    assert isinstance(report, ModelReport) and report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == ["enc.0", "dec.0", "cross.0"]
    assert [r.kind for _, r in report.layers] == ["multihead", "causal-multihead", "cross"]


class _Seq2SeqAttn(torch.nn.Module):
    """BART-like attention: ``forward(hidden, memory=None)``; ``slip``: "source" (keys and
    values from ``hidden`` though handed ``memory``), "keys_source" / "values_source" (only
    the keys / only the values from ``hidden``), "scale" (scores divided by head_dim)."""

    def __init__(self, d: int, heads: int, causal: bool = False, slip: str | None = None):
        super().__init__()
        self.h, self.causal, self.slip = heads, causal, slip
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            torch.nn.Linear(d, d) for _ in range(4)
        )

    def forward(self, hidden, memory=None):
        src = hidden if memory is None or self.slip == "source" else memory
        b, n, d = hidden.shape
        hd = d // self.h
        q = self.q_proj(hidden).view(b, n, self.h, hd).transpose(1, 2)
        ks = hidden if self.slip == "keys_source" else src
        vs = hidden if self.slip == "values_source" else src
        k = self.k_proj(ks).view(b, ks.shape[1], self.h, hd).transpose(1, 2)
        v = self.v_proj(vs).view(b, vs.shape[1], self.h, hd).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / (hd if self.slip == "scale" else hd**0.5)
        if self.causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.out_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _Seq2SeqBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int, decoder: bool, slip: str | None = None):
        super().__init__()
        self.self_attn = _Seq2SeqAttn(d, heads, causal=decoder)
        self.norm1 = torch.nn.LayerNorm(d)
        self.cross_attn = _Seq2SeqAttn(d, heads, slip=slip) if decoder else None
        self.norm2 = torch.nn.LayerNorm(d) if decoder else None
        self.ffn = torch.nn.Sequential(
            torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d)
        )
        self.norm3 = torch.nn.LayerNorm(d)

    def forward(self, x, memory=None):
        x = x + self.self_attn(self.norm1(x))
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.norm2(x), memory=memory)
        return x + self.ffn(self.norm3(x))


class _Seq2Seq(torch.nn.Module):
    """Token ids in: an encoder over them (bidirectional), a decoder over them (causal
    self-attention, cross-attention to the encoder's output handed by keyword), logits out.
    ``slip`` in decoder block 1's cross-attention."""

    def __init__(self, slip: str | None = None, vocab: int = 60, d: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(vocab, d)
        self.enc_pos = torch.nn.Parameter(torch.randn(32, d) * 0.3)
        self.dec_pos = torch.nn.Parameter(torch.randn(32, d) * 0.3)
        self.encoder = torch.nn.ModuleList([_Seq2SeqBlock(d, heads, False) for _ in range(2)])
        self.decoder = torch.nn.ModuleList(
            [_Seq2SeqBlock(d, heads, True, slip if i == 1 else None) for i in range(2)]
        )
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        n = ids.shape[1]
        memory = self.embed(ids) + self.enc_pos[:n]
        for block in self.encoder:
            memory = block(memory)
        x = self.embed(ids) + self.dec_pos[:n]
        for block in self.decoder:
            x = block(x, memory)
        return self.head(self.norm(x))


_SEQ2SEQ_LAYERS = [
    "encoder.0.self_attn",
    "encoder.1.self_attn",
    "decoder.0.self_attn",
    "decoder.0.cross_attn",
    "decoder.1.self_attn",
    "decoder.1.cross_attn",
]
_SEQ2SEQ_KINDS = ["multihead"] * 2 + ["causal-multihead", "cross"] * 2


@pytest.mark.parametrize("kind", [None, "causal-multihead"])
def test_an_encoder_decoder_model_passes_with_every_layer_kind_read(kind):
    """A correct encoder-decoder model: the encoder's layers are multihead, the decoder's
    self-attention causal, its cross-attention cross, read from the computation (a model's
    --kind is its decoder's self-attention layers': the encoder's, whose output the
    cross-attention reads, are read)."""
    report = check(lambda: _Seq2Seq().eval(), kind=kind)
    assert isinstance(report, ModelReport) and report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == _SEQ2SEQ_LAYERS
    assert [r.kind for _, r in report.layers] == _SEQ2SEQ_KINDS
    assert report.decode is None  # decoding an encoder-decoder model is not modelled


@pytest.mark.parametrize("kind", [None, "causal-multihead"])
@pytest.mark.parametrize(
    ("slip", "stage", "mistake"),
    [
        ("source", "keys", "wrong_source"),
        ("keys_source", "keys", "wrong_source"),
        ("values_source", "values", "wrong_source"),
        ("scale", "scaled_scores", "wrong_scale"),
    ],
)
def test_a_slip_in_one_cross_attention_layer_is_named(kind, slip, stage, mistake):
    report = check(lambda: _Seq2Seq(slip).eval(), kind=kind)
    assert isinstance(report, ModelReport) and not report.ok
    assert [r.kind for _, r in report.layers] == _SEQ2SEQ_KINDS
    failure = report.first_failure
    assert report.first_layer == "decoder.1.cross_attn", report.to_text(color=False)
    assert (failure.stage.value, failure.mistake) == (stage, mistake)


def _hf_bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=80,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    return transformers.BartModel(config).eval()


class _HFWhisperBuiltinAudio(torch.nn.Module):
    """Hugging Face's WhisperModel with its mel features built in (token ids in): the bare
    model takes two inputs (mel features and decoder ids), which a model run on one input
    does not model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.WhisperConfig(
            vocab_size=80,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_mel_bins=8,
            max_source_positions=12,
            max_target_positions=32,
        )
        self.whisper = transformers.WhisperModel(config)
        self.register_buffer("mel", torch.randn(1, 8, 24))

    def forward(self, ids):
        mel = self.mel.expand(ids.shape[0], -1, -1)
        out = self.whisper(input_features=mel, decoder_input_ids=ids, use_cache=False)
        return out.last_hidden_state


@pytest.mark.parametrize("kind", [None, "causal-multihead"])
@pytest.mark.parametrize(
    ("factory", "prefix", "cross"),
    [
        (_hf_bart, "", "encoder_attn"),
        (lambda: _HFWhisperBuiltinAudio().eval(), "whisper.", "encoder_attn"),
    ],
    ids=["bart", "whisper-builtin-audio"],
)
def test_hugging_face_encoder_decoder_models_pass(factory, prefix, cross, kind):
    """Hugging Face's BART and Whisper (small configs, random weights): the encoder's layer,
    the decoder's causal self-attention and its cross-attention (on the encoder's output the
    model hands it) each pass with its kind read."""
    report = check(factory, kind=kind)
    assert isinstance(report, ModelReport) and report.ok, report.to_text(color=False)
    assert [p for p, _ in report.layers] == [
        f"{prefix}encoder.layers.0.self_attn",
        f"{prefix}decoder.layers.0.self_attn",
        f"{prefix}decoder.layers.0.{cross}",
    ]
    assert [r.kind for _, r in report.layers] == ["multihead", "causal-multihead", "cross"]


class _QKVAttn(torch.nn.Module):
    """``forward(query, key, value)`` (the seq2seq tutorials' MultiHeadAttentionLayer), the
    model hands the same encoder output as ``key`` and ``value``; ``slip``: values read from
    the query."""

    def __init__(self, d: int, heads: int, causal: bool = False, slip: bool = False):
        super().__init__()
        self.h, self.causal, self.slip = heads, causal, slip
        self.fc_q, self.fc_k, self.fc_v, self.fc_o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, query, key, value):
        b, n, d = query.shape
        hd = d // self.h
        value = query if self.slip else value
        q = self.fc_q(query).view(b, n, self.h, hd).transpose(1, 2)
        k = self.fc_k(key).view(b, -1, self.h, hd).transpose(1, 2)
        v = self.fc_v(value).view(b, -1, self.h, hd).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / hd**0.5
        if self.causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.fc_o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _QKVSeq2Seq(torch.nn.Module):
    def __init__(self, slip: bool = False, vocab: int = 60, d: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(4)
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(32, d) * 0.3)
        self.enc = torch.nn.ModuleList([_QKVAttn(d, heads)])
        self.dec = torch.nn.ModuleList([_QKVAttn(d, heads, causal=True)])
        self.cross = torch.nn.ModuleList([_QKVAttn(d, heads, slip=slip)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        e = self.embed(ids) + self.pos[: ids.shape[1]]
        memory = e + self.enc[0](e, e, e)
        x = e * 0.5
        x = x + self.dec[0](x, x, x)
        x = x + self.cross[0](x, memory, memory)
        return self.head(x)


@pytest.mark.parametrize("slip", [False, True])
def test_cross_attention_handed_its_other_sequence_as_both_key_and_value_is_checked(slip):
    """One tensor handed at two arguments (``attn(x, memory, memory)``) is one sequence: the
    layer is cross-attention, checked where it sits."""
    report = check(lambda: _QKVSeq2Seq(slip).eval(), decode="none")
    assert isinstance(report, ModelReport), report
    assert [p for p, _ in report.layers] == ["enc.0", "dec.0", "cross.0"]
    assert [r.kind for _, r in report.layers] == ["multihead", "causal-multihead", "cross"]
    assert report.ok != slip, report.to_text(color=False)
    if slip:
        assert report.first_layer == "cross.0"
        assert (report.first_failure.stage.value, report.first_failure.mistake) == (
            "values",
            "wrong_source",
        )


class _OneHead(torch.nn.Module):
    def __init__(self, d: int, hd: int, slip: bool = False):
        super().__init__()
        self.key, self.query, self.value = (torch.nn.Linear(d, hd, bias=False) for _ in range(3))
        self.slip = slip

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        s = q @ k.transpose(-2, -1) * (1.0 if self.slip else k.shape[-1] ** -0.5)
        n = x.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return s.softmax(-1) @ v


class _HeadsConcatenated(torch.nn.Module):
    """One module per head, their contexts concatenated and projected together (the
    lecture GPT's MultiHeadAttention)."""

    def __init__(self, d: int, heads: int, slip: bool = False):
        super().__init__()
        self.heads = torch.nn.ModuleList(
            _OneHead(d, d // heads, slip and h == 2) for h in range(heads)
        )
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class _PerHeadGPT(torch.nn.Module):
    def __init__(self, slip: bool = False, vocab: int = 60, d: int = 32):
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(32, d) * 0.3)
        self.blocks = torch.nn.ModuleList(
            [_HeadsConcatenated(d, 4, slip and i == 1) for i in range(2)]
        )
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = x + blk(x)
        return self.head(x)


@pytest.mark.parametrize("slip", [False, True])
def test_heads_computed_apart_and_projected_together_are_one_layer(slip):
    """A module per head whose contexts are concatenated into one output projection: the
    layer is the module that joins them, not each head."""
    report = check(lambda: _PerHeadGPT(slip).eval(), decode="none")
    assert isinstance(report, ModelReport), report
    assert [p for p, _ in report.layers] == ["blocks.0", "blocks.1"]
    assert report.ok != slip, report.to_text(color=False)
    if slip:
        assert report.first_layer == "blocks.1"


class _OnlineSoftmaxAttention(torch.nn.Module):
    """A FlashAttention-1 loop written by hand: key blocks of 3, a running maximum and sum
    rescaling the accumulated context, divided at the end (exact)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x, block=3):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.h, self.hd).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        m = torch.full((b, self.h, n, 1), float("-inf"))
        total, acc = torch.zeros(b, self.h, n, 1), torch.zeros_like(q)
        pos = torch.arange(n)
        for start in range(0, n, block):
            s = q @ k[:, :, start : start + block].transpose(-1, -2) / math.sqrt(self.hd)
            s = s.masked_fill(pos[start : start + block][None, :] > pos[:, None], float("-inf"))
            new = torch.maximum(m, s.amax(-1, keepdim=True))
            p, alpha = torch.exp(s - new), torch.exp(m - new)
            total = alpha * total + p.sum(-1, keepdim=True)
            acc = alpha * acc + p @ v[:, :, start : start + block]
            m = new
        return self.out((acc / total).transpose(1, 2).reshape(b, n, d))


class _OnlineSoftmaxLM(torch.nn.Module):
    def __init__(self, vocab=50, d=32, layers=3):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(_OnlineSoftmaxAttention(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_layers_whose_context_an_online_softmax_rescales_are_all_found():
    """The running factors are made from the scores; once projected, a layer's output is
    not scores (only the first layer had been found)."""
    report = check(lambda: _OnlineSoftmaxLM().eval())
    assert report.ok, report.to_text(color=False)
    assert len(report.layers) == 3
