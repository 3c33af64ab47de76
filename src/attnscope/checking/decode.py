"""Incremental decoding with a model's own key/value cache, against the full pass.

A prompt runs with the cache on, then one token at a time; every step's output and every
attention layer's output for the new token must equal the full pass over the same tokens
(a causal model's position ``p`` never depends on what comes after it). The first step and
the first layer that differ are the failure, named from what the evidence shows:

- ``cache_positions``: the new token reaches the first layer otherwise than in the full pass
  (its learned position embedding not offset by the cache length), or the layer is handed
  other rotary tables for it;
- ``cache_mask``: the first step already differs with the same inputs: the new token does
  not see the cached keys as it should;
- ``cache_stale``: the first step is right and a later one is not: the cache was not
  updated (or updated twice) after a step;
- ``cache_other``: anything else, a decoding step that raises included.

Driven the way the model is meant to be: Hugging Face models with ``use_cache`` and
``past_key_values``; the book's KV-cache models with ``use_cache=True`` and a ``cache=`` it
fills (``llms_from_scratch.kv_cache``), its position counter reset first.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .compare import close
from .probe import first_tensor
from .record import short_path

__all__ = ["Decode", "check_decoding"]

PROMPT, STEPS = 5, 8


@dataclass
class Decode:
    """The contract's ``decode``: the first step and layer that diverge, and why."""

    ok: bool
    steps: int
    step: int | None = None
    layer: str | None = None
    mistake: str | None = None
    message: str = ""

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "steps": self.steps,
            "first_divergent_step": self.step,
            "layer": self.layer,
            "mistake": self.mistake,
            "message": self.message or f"{self.steps} cached steps equal the full pass",
        }


def _params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class _Driver:
    """How to run one model with and without its cache."""

    def __init__(self, model: nn.Module, layers: int):
        self.model, self.layers = model, layers
        names = _params(model)
        # Hugging Face: the cache argument is past_key_values (cache from transformers 5)
        self.hf = type(model).__module__.startswith("transformers") and "use_cache" in names
        self.cache_arg = "past_key_values" if "past_key_values" in names else "cache"
        self.hf = self.hf and self.cache_arg in names
        # the book's KV-cache models: cache= (and use_cache=True for its GPT-2 variant)
        self.book = (
            not self.hf
            and "cache" in names
            and ("use_cache" in names or callable(getattr(model, "reset_kv_cache", None)))
        )
        self.book_flag = {"use_cache": True} if "use_cache" in names else {}
        self._cache = None

    @property
    def usable(self) -> bool:
        return self.hf or self.book

    def full(self, ids: torch.Tensor):
        if self.hf:
            return self.model(ids, use_cache=False)
        self._reset()
        return self.model(ids)

    def start(self, ids: torch.Tensor):
        if self.hf:
            out = self.model(ids, use_cache=True)
            self._cache = _returned_cache(out)
            return out
        self._reset()
        self._cache = _book_cache(self.model, self.layers)
        return self.model(ids, cache=self._cache, **self.book_flag)

    def step(self, ids: torch.Tensor):
        if self.hf:
            out = self.model(ids, use_cache=True, **{self.cache_arg: self._cache})
            self._cache = _returned_cache(out)
            return out
        return self.model(ids, cache=self._cache, **self.book_flag)

    def _reset(self) -> None:
        reset = getattr(self.model, "reset_kv_cache", None)
        if callable(reset):
            reset()
        if hasattr(self.model, "current_pos"):
            self.model.current_pos = 0


def _returned_cache(out):
    for name in ("past_key_values", "cache"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    return None


def _book_cache(model: nn.Module, layers: int):
    """The book's external ``KVCache``, one slot per attention layer the model runs."""
    from llms_from_scratch.kv_cache.utils import KVCache

    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, dict) and "n_layers" in cfg:
        return KVCache(n_layers=cfg["n_layers"])
    return KVCache(n_layers=layers)


def _output(result) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        t = getattr(result, name, None)
        if isinstance(t, torch.Tensor):
            return t
    return first_tensor(result)


class _Taps:
    """Each attention layer's input and output, per call of the model."""

    def __init__(self, layers: list[tuple[str, nn.Module]]):
        self.layers = layers
        self.seen: dict[str, dict] = {}
        self.hooks: list = []

    def __enter__(self):
        for path, m in self.layers:
            self.hooks.append(m.register_forward_pre_hook(self._in(path), with_kwargs=True))
            self.hooks.append(m.register_forward_hook(self._out(path)))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()

    def _in(self, path):
        def hook(mod, args, kwargs):
            self.seen.setdefault(path, {})["args"] = (args, dict(kwargs))

        return hook

    def _out(self, path):
        def hook(mod, args, out):
            self.seen.setdefault(path, {})["out"] = first_tensor(out).detach()

        return hook


def _raised(exc: BaseException) -> str:
    """``TypeError: ... (at file:line)``: the exception and the innermost line of the model's
    own code (not torch's) it came from."""
    where = None
    tb = exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if "/torch/" not in path and "attnscope" not in path:
            where = f"{short_path(path)}:{tb.tb_lineno}"
        tb = tb.tb_next
    text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return text + (f" (at {where})" if where else "")


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2:
            return a.detach()
    return None


def _rotary(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    pe = kwargs.get("position_embeddings")
    if isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(t, torch.Tensor) for t in pe):
        return pe
    return None


def check_decoding(
    model: nn.Module, layers: list[tuple[str, nn.Module]], ids: torch.Tensor
) -> Decode | None:
    """Cached decoding of ``ids`` ``(B, PROMPT + STEPS)`` against the full pass, or None where
    the model has no cache the checker knows how to drive."""
    drive = _Driver(model, len(layers))
    if not drive.usable:
        return None
    with torch.no_grad():
        with _Taps(layers) as full_taps:
            full = _output(drive.full(ids)).double()
        reference = {p: full_taps.seen[p] for p, _ in layers if p in full_taps.seen}
        try:
            drive.start(ids[:, :PROMPT])
        except Exception as exc:  # noqa: BLE001  (the model's own error, reported)
            return Decode(
                False,
                STEPS,
                0,
                None,
                "cache_other",
                f"the prompt with the cache raised {_raised(exc)}",
            )
        for t in range(STEPS):
            pos = PROMPT + t
            with _Taps(layers) as taps:
                try:
                    out = _output(drive.step(ids[:, pos : pos + 1])).double()
                except Exception as exc:  # noqa: BLE001
                    return Decode(
                        False, STEPS, t, None, "cache_other", f"step {t} raised {_raised(exc)}"
                    )
            for path, _ in layers:
                got, want = taps.seen.get(path), reference.get(path)
                if got is None or want is None or "out" not in got:
                    continue
                if close(got["out"][:, -1:].double(), want["out"][:, pos : pos + 1].double()):
                    continue
                code, why = _name(got, want, pos, t, path == layers[0][0])
                return Decode(
                    False,
                    STEPS,
                    t,
                    path,
                    code,
                    f"step {t} (token {pos}), layer {path!r}: its output for the new token "
                    f"differs from the full pass: {why}",
                )
            if not close(out[:, -1:], full[:, pos : pos + 1]):
                return Decode(
                    False,
                    STEPS,
                    t,
                    None,
                    "cache_other",
                    f"step {t} (token {pos}): the model's output differs from the full pass "
                    "while every attention layer's agrees",
                )
    return Decode(True, STEPS)


def _name(got: dict, want: dict, pos: int, step: int, first_layer: bool) -> tuple[str, str]:
    """The mistake the evidence at the first diverging layer shows, and a sentence."""
    g_args, g_kwargs = got["args"]
    w_args, w_kwargs = want["args"]
    h_got, h_want = _hidden(g_args, g_kwargs), _hidden(w_args, w_kwargs)
    same_input = (
        h_got is not None
        and h_want is not None
        and close(h_got[:, -1:].double(), h_want[:, pos : pos + 1].double())
    )
    if first_layer and not same_input:
        return (
            "cache_positions",
            "the new token reaches the first layer otherwise than in the full pass (its "
            "position embedding not offset by the cache length?)",
        )
    r_got, r_want = _rotary(g_kwargs), _rotary(w_kwargs)
    if r_got is not None and r_want is not None:
        cos_got, cos_want = r_got[0][..., -1:, :], r_want[0][..., pos : pos + 1, :]
        if cos_got.shape == cos_want.shape and not close(cos_got.double(), cos_want.double()):
            return (
                "cache_positions",
                "the layer is handed rotary tables for another position than the token's",
            )
    if same_input and step == 0:
        return (
            "cache_mask",
            "with the same input, the first cached step already differs: the new token does "
            "not see the cached keys as the full pass does",
        )
    if same_input:
        return (
            "cache_stale",
            f"steps 0..{step - 1} agree and step {step} does not: the cache was not updated "
            "(or was updated twice) after a step",
        )
    return "cache_other", "its input already differs, and no earlier layer explains it"
