"""Cached decoding against the full pass: a model's own key/value cache, step by step, every
attention layer's output for the new token held to the full forward over the same tokens."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import GALLERY, ROOT
from torch import nn

from attnscope import AttnScopeError, check
from attnscope.cli import main

MODELS = GALLERY / "models"


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed")


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, bug: str | None):
        super().__init__()
        self.h, self.hd, self.bug = heads, d // heads, bug
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, cache=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if self.bug == "scaled_key":  # the decoding path makes its key otherwise
                k = k * 0.5
            old_k, old_v = cache
            if self.bug == "twice" and old_k.shape[2] == 5:  # the prompt stored twice
                old_k, old_v = torch.cat([old_k, old_k], dim=2), torch.cat([old_v, old_v], 2)
            if self.bug == "empty":  # three empty slots in front, not masked
                empty = old_k.new_zeros(b, self.h, 3, self.hd)
                old_k, old_v = torch.cat([empty, old_k], 2), torch.cat([empty, old_v], 2)
            if self.bug == "mask":  # the new token attends to itself alone
                old_k, old_v = old_k[:, :, :0], old_v[:, :, :0]
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        kept = k, v
        if cache is not None and self.bug == "recent":
            # the step reads its own and the last two cached tokens; the cache keeps them
            # all (a page table walked from the last page)
            k, v = k[:, :, -3:], v[:, :, -3:]
        s = q @ k.transpose(-2, -1) / self.hd**0.5
        total = k.shape[2]
        rows = torch.arange(total - n, total)[:, None]
        s = s.masked_fill(torch.arange(total)[None, :] > rows, float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        return self.out(y), kept


class TinyGPT(nn.Module):
    """A small GPT of our own with the book's cache protocol: cache=KVCache, use_cache."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, context=64, bug=None):
        super().__init__()
        self.bug = bug
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_Attention(d, heads, bug) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.current_pos = 0

    def forward(self, ids, use_cache=False, cache=None):
        n = ids.shape[1]
        start = self.current_pos if use_cache else 0
        if use_cache and self.bug != "positions":
            self.current_pos += n
        x = self.tok(ids) + self.pos(torch.arange(start, start + n))
        for i, block in enumerate(self.blocks):
            past = cache.get(i) if use_cache and cache is not None else None
            x, kv = block(x, past)
            if self.bug == "never" and past is None:
                continue  # the prompt's keys and values are never stored
            if use_cache and cache is not None:
                stale = self.bug == "stale" and past is not None
                cache.update(i, past if stale else kv)
        return self.head(self.norm(x))


def _tiny(bug=None):
    def make():
        torch.manual_seed(0)
        return TinyGPT(bug=bug)

    return make


def test_a_correct_cache_decodes_like_the_full_pass():
    report = check(_tiny())
    assert report.ok, report.to_text(color=False)
    assert report.decode.ok and report.decode.steps == 8


@pytest.mark.parametrize(
    "bug,code,step",
    [
        ("positions", "cache_positions", 0),
        ("mask", "cache_mask", 0),
        ("recent", "cache_mask", 0),
        ("stale", "cache_stale", 1),
        ("twice", "cache_stale", 0),
        ("empty", "cache_mask", 0),
        ("never", "cache_stale", 0),
        # a new key that is no rotation of the full pass's (its length differs): not a
        # position, something else (a norm skipped on the decoding path)
        ("scaled_key", "cache_other", 0),
    ],
)
def test_each_decoding_bug_is_named_with_its_step_and_layer(bug, code, step):
    report = check(_tiny(bug))
    assert all(r.ok for _, r in report.layers)  # every layer is right without the cache
    d = report.decode
    assert not report.ok and not d.ok
    assert (d.mistake, d.step) == (code, step), d.message
    assert d.layer == "blocks.0"
    assert report.to_dict()["decode"]["first_divergent_step"] == step


def test_hugging_face_language_models_decode_with_their_own_cache(report_schema):
    import jsonschema

    transformers = _transformers()
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=100,
        intermediate_size=64,
    )
    report = check(lambda: transformers.LlamaForCausalLM(cfg))
    assert report.ok and report.decode.ok, report.decode.message
    jsonschema.validate(report.to_dict(), report_schema)


def test_a_decoding_step_that_raises_is_cache_other_with_its_line():
    """The book's own GPT-2 KV-cache module (llms-from-scratch 1.0.19) slices its causal
    mask by columns on a one-token step: the step raises, and the report says where."""
    pytest.importorskip("llms_from_scratch", reason="llms-from-scratch not installed")
    gpt2 = pytest.importorskip("llms_from_scratch.kv_cache.gpt2")
    cfg = {
        "vocab_size": 100,
        "context_length": 32,
        "emb_dim": 32,
        "n_heads": 4,
        "n_layers": 2,
        "drop_rate": 0.0,
        "qkv_bias": False,
    }
    report = check(lambda: gpt2.GPTModel(cfg))
    d = report.decode
    if d.ok:  # a later release of the book's package may fix it
        pytest.skip("the book's GPT-2 KV-cache model decodes correctly in this release")
    assert d.mistake == "cache_other" and "raised" in d.message and "gpt2.py:" in d.message


def test_the_books_kv_cache_llama3_and_qwen3_models():
    """The book's Llama 3 and Qwen 3 with their KV cache: every layer (grouped heads, RoPE,
    Qwen's QK norm) checked where it sits, and cached decoding equal to the full pass."""
    pytest.importorskip("llms_from_scratch", reason="llms-from-scratch not installed")
    l3 = pytest.importorskip("llms_from_scratch.kv_cache.llama3")
    q3 = pytest.importorskip("llms_from_scratch.kv_cache.qwen3")
    common = dict(vocab_size=100, context_length=64, emb_dim=32, n_heads=4, n_layers=2)
    common |= dict(hidden_dim=64, n_kv_groups=2, dtype=torch.float32)
    llama = check(lambda: l3.Llama3Model(common | dict(rope_base=500_000.0, rope_freq=None)))
    qwen = check(
        lambda: q3.Qwen3Model(common | dict(head_dim=16, qk_norm=True, rope_base=1_000_000.0))
    )
    for report, norm in ((llama, None), (qwen, "per-head")):
        assert report.ok and report.decode.ok, report.to_text(color=False)
        assert [p for p, _ in report.layers] == ["trf_blocks.0.att", "trf_blocks.1.att"]
        assert all(r.structure["kv_heads"] == 2 for _, r in report.layers)
        assert all(r.structure["qk_norm"] == norm for _, r in report.layers)


# --- protocols: by what the forward takes, not by where the class comes from ---------------


def _gallery(name: str) -> str:
    return f"{MODELS / name}.py:make_model"


@pytest.mark.parametrize(
    "name,protocol",
    [
        ("correct_gpt_chapter_buffers", "buffers"),
        ("correct_gpt_external_cache", "cache"),
        ("correct_hf_style_tuple", "hf"),
        ("correct_meta_style_start_pos", "buffers"),
    ],
)
def test_each_protocol_decodes_a_correct_model(name, protocol):
    """The chapter's cache in buffers (no cache argument), a cache= with the module's own
    KVCache class, a hand-written Hugging Face-style model returning a tuple, Meta's
    forward(tokens, start_pos) with caches preallocated in buffers."""
    report = check(_gallery(name))
    assert report.ok and report.decode is not None, report.to_text(color=False)
    assert report.decode.ok and report.decode.protocol == protocol


def test_the_cache_protocol_needs_no_llms_from_scratch(monkeypatch):
    """A model that takes cache= gets its module's KVCache, or attnscope's own; the book's
    package (a test-only dependency) is not imported for it."""
    for name in (
        "llms_from_scratch",
        "llms_from_scratch.kv_cache",
        "llms_from_scratch.kv_cache.utils",
    ):
        monkeypatch.setitem(sys.modules, name, None)  # any import of it raises ImportError
    from attnscope.checking.decode import KVCache, make_cache

    own = check(_gallery("correct_gpt_external_cache"))
    assert own.decode.ok and own.decode.protocol == "cache"
    ours = check(_tiny())  # this test module defines no cache class: attnscope's is used
    assert ours.decode.ok, ours.decode.message
    assert isinstance(make_cache(_tiny()(), 2), KVCache)


def test_a_cache_class_on_the_model_is_used():
    made = []

    class Slots:
        def __init__(self, n_layers):
            made.append(n_layers)
            self.slots = [None] * n_layers

        def get(self, i):
            return self.slots[i]

        def update(self, i, kv):
            self.slots[i] = kv

    class WithItsCache(TinyGPT):
        cache_class = Slots

    def make():
        torch.manual_seed(0)
        return WithItsCache()

    report = check(make)
    assert report.decode.ok and made and set(made) == {2}


class AsksItsPosition(TinyGPT):
    """Reads the position from the cache it is given (``cache.get_pos()``, nanochat's
    interface), and its module names no cache class."""

    def forward(self, ids, use_cache=False, cache=None):
        if cache is not None:
            self.current_pos = cache.get_pos()
        return super().forward(ids, use_cache=use_cache, cache=cache)


def test_a_cache_of_another_interface_than_the_stand_in_is_refused_not_judged():
    """attnscope's stand-in KVCache has get/update; a model that asks its cache for more
    expects another one: exit 2 naming the call, not the model's mistake cache_other."""

    def make():
        torch.manual_seed(0)
        return AsksItsPosition()

    with pytest.raises(AttnScopeError, match=r"cache\.get_pos.*--decode none"):
        check(make)
    assert check(make, decode="none").ok


def test_a_hugging_face_model_returning_a_tuple_decodes():
    """return_dict=False: (logits, cache) instead of an output object."""
    transformers = _transformers()
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=100,
        intermediate_size=64,
    )

    class TupleLlama(transformers.LlamaForCausalLM):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            out = super().forward(input_ids, cache=past_key_values, use_cache=use_cache)
            return (out.logits, out.past_key_values) if use_cache else (out.logits,)

    def make():
        torch.manual_seed(0)
        return TupleLlama(cfg)

    report = check(make)
    assert report.ok and report.decode.ok and report.decode.protocol == "hf", report.decode.message


# --- decode= and --decode ----------------------------------------------------------------------


def test_decode_none_skips_decoding_and_a_named_protocol_is_used():
    assert check(_tiny("stale"), decode="none").decode is None
    assert check(_tiny("stale"), decode="none").ok
    report = check(_tiny("stale"), decode="cache")
    assert report.decode.mistake == "cache_stale" and report.decode.protocol == "cache"


@pytest.mark.parametrize(
    "decode,words",
    [
        ("buffers", "reset_kv_cache.*without reset_kv_cache"),
        ("hf", "past_key_values.*returned no cache"),
    ],
)
def test_a_protocol_that_does_not_fit_is_refused_naming_what_was_expected(decode, words):
    with pytest.raises(AttnScopeError, match=f"--decode {decode}: expected .*{words}"):
        check(_tiny(), decode=decode)


def test_decode_is_refused_for_one_layer_and_for_an_unknown_value():
    layer = f"{GALLERY / 'correct' / 'mha_book.py'}:MultiHeadAttention"
    with pytest.raises(AttnScopeError, match="expected a whole model"):
        check(layer, decode="cache")
    assert check(layer, decode="none").ok
    with pytest.raises(AttnScopeError, match="expected one of hf, buffers, cache, none"):
        check(_tiny(), decode="kv")


def test_cli_decode(capsys):
    target = f"{ROOT / 'tests' / 'test_check_decode.py'}:_stale"
    assert main(["check", target, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["decode"]["mistake"] == "cache_stale"
    assert main(["check", target, "--json", "--decode", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["decode"] is None
    assert main(["check", target, "--json", "--decode", "buffers"]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]["message"]
    assert "--decode buffers: expected" in error and "reset_kv_cache" in error
    assert "--decode buffers: expected" in captured.err
    assert main(["check", target, "--decode", "kv"]) == 2
    assert "invalid choice" in capsys.readouterr().err


_stale = _tiny("stale")


# --- the classifier names each code from evidence ----------------------------------------------


@pytest.mark.parametrize(
    "name,code,step,layer",
    [
        ("buggy_cache_positions_heads_axis", "cache_positions", 0, "layers.0.self_attn"),
        ("buggy_cache_stale_updated_twice", "cache_stale", 0, "blocks.0.attn"),
        ("buggy_cache_mask_first_rows", "cache_mask", 0, "trf_blocks.0.att"),
        ("buggy_cache_other_cat_heads", "cache_other", 0, "layers.0.self_attn"),
        ("buggy_cache_mask_whole_buffer", "cache_mask", 0, "layers.0.attention"),
    ],
)
def test_the_gallery_decode_bugs_are_named_from_evidence(name, code, step, layer):
    report = check(_gallery(name))
    d = report.decode
    assert all(r.ok for _, r in report.layers)
    assert (d.mistake, d.step, d.layer) == (code, step, layer), d.message
    assert d.location and d.location.split(":")[0].endswith(f"{name}.py")


def test_the_prompt_cached_twice_is_stale_not_mask():
    """The known weakness: the prompt's keys and values held twice diverge at step 0 with
    the same input, which reads like a mask; the keys held say it is the cache."""
    d = check(_gallery("buggy_cache_stale_updated_twice")).decode
    assert d.mistake == "cache_stale" and "held twice" in d.message
    assert "0, 1, 2, 3, 4" in d.message


class PastOnly(nn.Module):
    """A hand-written Hugging Face-style model without use_cache: it always returns its
    presents, and takes them back as past_key_values."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, context=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_Attention(d, heads, None) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, past_key_values=None):
        n = input_ids.shape[1]
        start = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        x = self.tok(input_ids) + self.pos(torch.arange(start, start + n))
        presents = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past_key_values is None else past_key_values[i])
            presents.append(kv)
        return self.head(x), presents


def test_past_key_values_without_use_cache_is_the_hf_protocol():
    def make():
        torch.manual_seed(0)
        return PastOnly()

    report = check(make)
    assert report.ok and report.decode.ok and report.decode.protocol == "hf"
    with pytest.raises(AttnScopeError, match="--decode buffers: expected"):
        check(make, decode="buffers")


@pytest.mark.parametrize(
    "bug,words",
    [
        ("twice", "token(s) 0, 1, 2, 3, 4 are held twice"),
        ("stale", "token(s) 5 are missing"),
        ("empty", "3 empty slots of the cache are not masked"),
        ("mask", "its own key and value alone, none of the cached ones (which the step reads)"),
        ("never", "the step reads no cache of the 5 tokens before it (the cache not updated)"),
    ],
)
def test_the_evidence_is_in_the_message(bug, words):
    d = check(_tiny(bug)).decode
    assert words in d.message, d.message


def test_a_preallocated_cache_seen_whole_is_a_mask_that_shows_too_many():
    d = check(_gallery("buggy_cache_mask_whole_buffer")).decode
    assert d.mistake == "cache_mask" and "sees too many" in d.message
    assert "19 empty slots and 7 slots of later tokens" in d.message


def _gallery_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_decode_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the probe reads a class's module from sys.modules
    spec.loader.exec_module(module)
    return module


def test_a_query_rotated_for_another_position_is_cache_positions():
    """Keys (and values) cached right, and the new token's query alone rotated one position
    behind: the query held against the full pass's says it is the position, not the mask."""
    hf = _gallery_module("correct_hf_style_tuple")

    class QueryBehind(hf.Attention):
        def forward(self, hidden_states, cos, sin, past=None):
            if past is None:
                return super().forward(hidden_states, cos, sin, past)
            b, n, d = hidden_states.shape
            shape = (b, n, self.heads, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            behind = torch.arange(past[0].shape[2] - 1, past[0].shape[2] - 1 + n)
            cq, sq = hf.rope_tables(self.head_dim, behind)
            q = q * cq + hf.rotate_half(q) * sq
            k = k * cos + hf.rotate_half(k) * sin
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(b, n, d)), (k, v)

    def make():
        model = hf.make_model()
        for layer in model.layers:
            layer.self_attn.__class__ = QueryBehind
        return model

    report = check(make)
    assert all(r.ok for _, r in report.layers)
    d = report.decode
    assert (d.mistake, d.step, d.layer) == ("cache_positions", 0, "layers.0.self_attn"), d.message
    assert "query" in d.message


def test_a_forward_in_inference_mode_is_checked_without_it():
    """Meta's forward is decorated with torch.inference_mode, whose tensors cannot be
    recorded: it runs without, and the report says so."""
    report = check(_gallery("correct_meta_style_start_pos"))
    assert report.ok and report.decode.ok
    assert any("torch.inference_mode" in n for n in report.notes)


class DictOut(PastOnly):
    """Returns a plain dict: {"logits": ..., "presents": ...}."""

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        logits, presents = super().forward(input_ids, past_key_values)
        return {"logits": logits, "presents": presents if use_cache else None}


def test_a_model_returning_a_dict_decodes():
    def make():
        torch.manual_seed(0)
        return DictOut()

    report = check(make)
    assert report.ok and report.decode.ok and report.decode.protocol == "hf", report.decode


def test_keys_cached_as_values_are_cache_other():
    """A copy-paste slip stores the keys twice, (k, k): the cached values are no token's
    value in the full pass, whatever the mask does: cache_other, with the evidence."""

    class KeysTwice(_Attention):
        def forward(self, x, cache=None):
            out, (k, v) = super().forward(x, cache)
            return out, (k, k)

    def make():
        torch.manual_seed(0)
        model = TinyGPT()
        for block in model.blocks:
            block.__class__ = KeysTwice
        return model

    d = check(make).decode
    assert (d.mistake, d.step, d.layer) == ("cache_other", 0, "blocks.0"), d.message
    assert "no token's value in the full pass" in d.message


def test_the_text_report_says_how_it_decoded_and_where_to_look():
    text = check(_gallery("buggy_cache_mask_first_rows")).to_text(color=False)
    assert "decoding with its cache (buffers): FAIL  cache_mask at step 0" in text
    lines = text.splitlines()
    assert any(x.startswith("  at ") and "buggy_cache_mask_first_rows.py:" in x for x in lines)
    ok = check(_gallery("correct_hf_style_tuple")).to_text(color=False)
    assert "decoding with its cache (hf): pass  8 cached steps equal the full pass" in ok


def _incremental_state_model(time_first: bool):
    """A fairseq-style LM: its cache is a dict subclass its own module defines (keyed by
    layer, plus the step count for positions), layers run tokens first ``(T, B, d)`` or
    batch first, and only the new tokens are passed."""

    class IncrementalCache(dict):
        def __init__(self, n_layers=2):
            super().__init__()
            self["steps"] = 0

    class Attention(nn.Module):
        def __init__(self, d, heads, key):
            super().__init__()
            self.h, self.hd, self.key = heads, d // heads, key
            self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
            self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x, state=None):
            if time_first:
                x = x.transpose(0, 1)
            b, n, d = x.shape
            q, k, v = (
                p(x).view(b, n, self.h, self.hd).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            if state is not None:
                saved = state.get(self.key, {})
                if "prev_key" in saved:
                    k = torch.cat([saved["prev_key"], k], 2)
                    v = torch.cat([saved["prev_value"], v], 2)
                state[self.key] = {"prev_key": k, "prev_value": v}
            total = k.shape[2]
            s = q @ k.transpose(-2, -1) / self.hd**0.5
            rows = torch.arange(total - n, total)[:, None]
            s = s.masked_fill(torch.arange(total)[None, :] > rows, float("-inf"))
            y = self.out_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))
            return y.transpose(0, 1) if time_first else y

    class LM(nn.Module):
        def __init__(self, vocab=64, d=32, layers=2):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(64, d)
            self.attns = nn.ModuleList(Attention(d, 4, f"layer{i}") for i in range(layers))
            self.head = nn.Linear(d, vocab)

        def reset_kv_cache(self):
            pass

        def forward(self, ids, cache=None):
            n = ids.shape[1]
            start = cache["steps"] if cache is not None else 0
            x = self.tok(ids) + self.pos(torch.arange(start, start + n))
            if time_first:
                x = x.transpose(0, 1)
            for a in self.attns:
                x = x + a(x, cache)
            if cache is not None:
                cache["steps"] = start + n
            return self.head(x.transpose(0, 1) if time_first else x)

    return IncrementalCache, LM


@pytest.mark.parametrize("time_first", [False, True])
def test_a_dict_cache_of_the_models_module_with_layers_tokens_first(monkeypatch, time_first):
    """fairseq's incremental_state: a dict subclass the model's module defines is its cache
    (not attnscope's stand-in, which it would index by a string), and a layer run tokens
    first has its new token read along its token axis, not the batch axis."""
    import types

    cache, lm = _incremental_state_model(time_first)
    module = types.ModuleType("fairseq_like_lm")
    module.IncrementalCache, module.LM = cache, lm
    cache.__module__ = lm.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def make():
        torch.manual_seed(0)
        return lm()

    report = check(make, kind="causal-multihead")
    assert report.decode is not None and report.decode.protocol == "cache"
    assert report.decode.ok, report.decode.message


def test_a_model_indexing_the_stand_in_cache_otherwise_is_refused_not_judged():
    """A model whose module names no cache class and that indexes the stand-in KVCache by a
    key it has no slot for expects another cache: exit 2, not cache_other."""

    class ByKey(TinyGPT):
        def forward(self, ids, use_cache=False, cache=None):
            if cache is not None:
                self.current_pos = cache["steps"] if use_cache else 0
            return super().forward(ids, use_cache=use_cache, cache=cache)

    def make():
        torch.manual_seed(0)
        return ByKey()

    with pytest.raises(AttnScopeError, match=r"another way.*TypeError.*--decode none"):
        check(make)


def _offset_model(bug: str | None):
    """flash-attention's ``InferenceParams``: a cache object of the model's own module, named
    for no cache and with no get/update, holding ``offset`` and a dict of per-layer keys and
    values that the model fills and advances itself."""

    class InferenceState:
        def __init__(self, n_layers=None, max_batch_size=8):
            self.offset = 0
            self.memory = {}

    class OffsetLM(TinyGPT):
        def forward(self, ids, cache=None):
            n = ids.shape[1]
            start = cache.offset if cache is not None else 0
            at = 0 if bug == "positions" else start
            x = self.tok(ids) + self.pos(torch.arange(at, at + n))
            for i, block in enumerate(self.blocks):
                past = cache.memory.get(i) if cache is not None and start > 0 else None
                x, kv = block(x, past)
                if cache is not None:
                    cache.memory[i] = kv
            if cache is not None:
                cache.offset += n
            return self.head(self.norm(x))

    return InferenceState, OffsetLM


@pytest.mark.parametrize("bug", [None, "positions"])
def test_a_cache_object_of_the_models_module_named_for_no_cache_is_used(monkeypatch, bug):
    """The class of the model's own module that the model, handed it as ``cache=``, runs with
    and writes into is its cache, whatever its name and methods (not attnscope's stand-in,
    whose missing ``offset`` would refuse the model)."""
    import types

    state, lm = _offset_model(bug)
    module = types.ModuleType("flash_like_gpt")
    module.InferenceState, module.OffsetLM = state, lm
    state.__module__ = lm.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def make():
        torch.manual_seed(0)
        return lm()

    report = check(make)
    assert report.decode is not None and report.decode.protocol == "cache"
    if bug is None:
        assert report.ok and report.decode.ok, report.decode.message
    else:
        assert all(r.ok for _, r in report.layers)
        assert (report.decode.mistake, report.decode.step) == ("cache_positions", 0)


class _PoolAttention(nn.Module):
    """Keys and values written into a preallocated pool of blocks (as paged caches keep
    them: no axis as long as the cached tokens); ``self_only``: every step attends over its
    own keys alone (a prefill path taken for one-token steps) though the pool holds the
    earlier ones."""

    def __init__(self, d: int, heads: int, self_only: bool):
        super().__init__()
        self.h, self.hd, self.self_only = heads, d // heads, self_only
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.pool, self.pos = None, 0

    def forward(self, x, use_cache: bool):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        start = 0
        if use_cache:
            if self.pool is None:  # (k/v, batch, blocks, slots per block, heads, head_dim)
                self.pool = x.new_zeros(2, b, 9, 7, self.h, self.hd)
            start = self.pos
            flat = self.pool.view(2, b, 63, self.h, self.hd)
            flat[0, :, start : start + n] = k.transpose(1, 2)
            flat[1, :, start : start + n] = v.transpose(1, 2)
            self.pos += n
            if not self.self_only:
                k = flat[0, :, : self.pos].transpose(1, 2)
                v = flat[1, :, : self.pos].transpose(1, 2)
            else:
                start = 0
        s = q @ k.transpose(-2, -1) / self.hd**0.5
        rows = torch.arange(start, start + n)[:, None]
        s = s.masked_fill(torch.arange(k.shape[2])[None, :] > rows, float("-inf"))
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _PoolGPT(nn.Module):
    def __init__(self, self_only: bool, vocab=64, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(_PoolAttention(d, heads, self_only) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def reset_kv_cache(self):
        for blk in self.blocks:
            blk.pool, blk.pos = None, 0

    def forward(self, ids, use_cache=False):
        start = self.blocks[0].pos if use_cache else 0
        x = self.tok(ids) + self.pos(torch.arange(start, start + ids.shape[1]))
        for blk in self.blocks:
            x = x + blk(x, use_cache)
        return self.head(x)


@pytest.mark.parametrize("self_only", [False, True])
def test_a_step_that_sees_itself_alone_while_its_pool_holds_the_earlier_keys_is_mask(self_only):
    """Stale is a cache that lacks the earlier keys; a step that attends over its own key
    alone while the pool it writes into holds them (no axis as long as the cached tokens)
    is a mask."""
    report = check(lambda: _PoolGPT(self_only).eval())
    d = report.decode
    assert d is not None and d.ok != self_only, report.to_text(color=False)
    if self_only:
        assert (d.mistake, d.step, d.layer) == ("cache_mask", 0, "blocks.0"), d.message


def test_a_cache_kept_in_half_precision_is_named_at_the_first_step_that_reads_it():
    """Cached values rounded to float16: the outputs stay within float32 error for two steps
    and then do not. The prompt's rounded values were read from step 0 on, and that step
    already held them: the failure is step 0's, and the message says when it showed."""

    class HalfValues(_Attention):
        def forward(self, x, cache=None):
            out, (k, v) = super().forward(x, cache)
            return out, (k, v.half().float())

    def make():
        torch.manual_seed(2)  # a seed whose outputs diverge only at step 2
        model = TinyGPT()
        for block in model.blocks:
            block.__class__ = HalfValues
        return model

    d = check(make).decode
    assert (d.mistake, d.step, d.layer) == ("cache_other", 0, "blocks.0"), d.message
    assert "no token's value in the full pass" in d.message
    assert "within float32 error of the full pass until step 2" in d.message
