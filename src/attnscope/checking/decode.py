"""Incremental decoding with a model's own key/value cache, against the full pass.

A prompt runs with the cache on, then one token at a time; every step's output and every
attention layer's output for the new token must equal the full pass over the same tokens
(a causal model's position ``p`` never depends on what comes after it). The first step and
the first layer that differ are the failure, named from what the evidence shows:

- ``cache_positions``: the new token reaches the first layer otherwise than in the full pass
  (its learned position embedding not offset by the cache length), the layer is handed
  other rotary tables for it, or its query, or its key (among cached keys that are right),
  is not the full pass's for its position;
- ``cache_stale``: what the step attends over holds some token twice, or lacks one, or the
  step reads no cache at all (the cache updated twice, or not updated); or, without that
  evidence, the first step is right and a later one is not;
- ``cache_mask``: the keys and values the step attends over are the full pass's and its
  output is not; or slots beyond the token (empty, or left over) are seen; or the new token
  sees its own key alone while the step reads a cache of the tokens before it;
- ``cache_other``: anything else: cached values that are no token's value in the full
  pass, a decoding step that raises (with its line).

The evidence (:class:`_Evidence`): where the first diverging layer gets the same input as in
the full pass, the operands of its scores and context products (or of its fused call) are
read from a recorded second run of the full pass and of the decoding up to that step, and
held against each other token by token.

Driven by protocol (:data:`PROTOCOLS`, ``--decode``), read from the forward's parameters and
the model's methods, never from the package it comes from: ``hf`` (``past_key_values`` or
``cache`` handed back, Hugging Face's or a model written that way, returning an output
object or a tuple), ``buffers`` (``use_cache`` and ``reset_kv_cache()``, the cache kept in
the model), ``cache`` (a KVCache passed in, the book's ``llms_from_scratch`` protocol).
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AttnScopeError
from .compare import close
from .dataflow import Graph
from .features import MATMULS
from .probe import first_tensor
from .record import Op, Recorder, short_path

__all__ = ["Decode", "KVCache", "PROTOCOLS", "check_decoding", "decode_protocol", "make_cache"]

PROMPT, STEPS = 5, 8

#: the parameter a forward takes the position of its first token by, where the caller keeps
#: it (Meta's Llama: ``forward(tokens, start_pos)``, the cache in the layers' buffers)
START = "start_pos"


@dataclass
class Decode:
    """The contract's ``decode``: the first step and layer that diverge, and why."""

    ok: bool
    steps: int
    step: int | None = None
    layer: str | None = None
    mistake: str | None = None
    message: str = ""
    #: how the cache was driven: ``hf``, ``buffers`` or ``cache`` (see :data:`PROTOCOLS`)
    protocol: str | None = None
    #: ``file:line`` of the model's code to look at, when known (not in the JSON contract)
    location: str | None = None

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


#: how a model's cache is driven (``--decode``); ``none`` skips decoding
PROTOCOLS = ("hf", "buffers", "cache", "none")

#: what each protocol expects of the model, for the error when it does not fit
EXPECTED = {
    "hf": "a model whose forward takes past_key_values (or cache, as from transformers 5), "
    "use_cache where it has one, and returns the cache it filled (Hugging Face's protocol; "
    "an output object or a tuple)",
    "buffers": "a model whose forward takes use_cache, with a reset_kv_cache() method, or "
    "start_pos, and no cache argument (the cache held in the model's buffers, as in the "
    "book's chapter-style models or Meta's Llama)",
    "cache": "a model whose forward takes cache= (a KVCache with get and update, one slot "
    "per layer, as the book's llms_from_scratch models take)",
}

#: the parameters a Hugging Face-style forward is handed back the cache it returned by
_PAST = ("past_key_values", "past_kv", "past")
#: cache parameters of both kinds: Hugging Face's (transformers 5) where a call returns the
#: cache, else a KVCache object the model fills (the book's)
_CACHE = ("cache", "kv_cache")
#: the methods that empty a cache kept in the model
_RESETS = ("reset_kv_cache", "reset_cache", "clear_kv_cache", "clear_cache")


def _first(names: set[str], among: tuple[str, ...]) -> str | None:
    return next((n for n in among if n in names), None)


def _reset_method(model: nn.Module):
    return next((getattr(model, n) for n in _RESETS if callable(getattr(model, n, None))), None)


def _fits(model: nn.Module, protocol: str, ids: torch.Tensor | None = None) -> bool:
    names = _params(model)
    if protocol == "hf":
        if _first(names, _PAST):
            return True
        # cache= is the book's protocol too: Hugging Face's returns the cache it filled
        return _first(names, _CACHE) is not None and (ids is None or _returns_cache(model, ids))
    if protocol == "buffers":
        return _first(names, _PAST + _CACHE) is None and (
            ("use_cache" in names and _reset_method(model) is not None) or START in names
        )
    if protocol == "cache":
        return _first(names, _CACHE) is not None
    return protocol == "none"


def decode_protocol(
    model: nn.Module, asked: str | None = None, ids: torch.Tensor | None = None
) -> str | None:
    """The protocol to drive ``model``'s cache with: ``asked`` when it fits (an
    :class:`AttnScopeError` naming what was expected when it does not), else the first that
    fits, read from the forward's parameters and the model's methods (not from where the
    class comes from); None when none does. A forward taking ``cache`` is Hugging Face's
    (transformers 5) when a call on ``ids`` returns a cache, the book's otherwise."""
    if asked is not None:
        if asked not in PROTOCOLS:
            raise AttnScopeError(f"--decode: expected one of {', '.join(PROTOCOLS)}, got {asked!r}")
        if not _fits(model, asked, ids):
            names = _params(model)
            params = ", ".join(sorted(names)) or "nothing readable"
            if asked == "hf" and _first(names, _CACHE):
                more = ", and a call of it returned no cache"
            elif asked == "buffers":
                more = ", with" + ("" if _reset_method(model) else "out") + " reset_kv_cache()"
            else:
                more = ""
            raise AttnScopeError(
                f"--decode {asked}: expected {EXPECTED[asked]}; {type(model).__name__}'s "
                f"forward takes ({params}){more}"
            )
        return asked
    names = _params(model)
    if _first(names, _PAST):
        return "hf"
    if _first(names, _CACHE):
        if ids is not None and _returns_cache(model, ids):
            return "hf"
        if (
            "use_cache" in names
            or _reset_method(model) is not None
            or _cache_class(model) is not None
        ):
            return "cache"
    if _fits(model, "buffers"):
        return "buffers"
    return None


def _returns_cache(model: nn.Module, ids: torch.Tensor) -> bool:
    flag = {"use_cache": True} if "use_cache" in _params(model) else {}
    try:
        with torch.no_grad():
            out = model(ids, **flag)
    except Exception:  # noqa: BLE001  (it wants its cache passed in: not Hugging Face's)
        return False
    finally:
        _Driver(model, 0, "cache")._reset()
    return _returned_cache(out) is not None


class _Driver:
    """How to run one model with and without its cache, by ``protocol`` (``use_cache``
    passed where the forward takes it):

    - ``hf``: ``model(ids, use_cache=False)``; the prompt with ``use_cache=True``, each step
      with ``past_key_values=`` (or ``cache=``) the cache the previous call returned;
    - ``buffers``: ``reset_kv_cache()`` then ``model(ids)``; the prompt after a reset and
      each step with ``use_cache=True``, the model keeping its cache and position itself
      (or handed the position as ``start_pos=``, Meta's Llama);
    - ``cache``: a KVCache made for the model (see :func:`make_cache`) passed as ``cache=``,
      the position counter reset first.
    """

    def __init__(self, model: nn.Module, layers: int, protocol: str):
        self.model, self.layers, self.protocol = model, layers, protocol
        names = _params(model)
        takes = "use_cache" in names
        self.on = {"use_cache": True} if takes else {}
        self.off = {"use_cache": False} if takes else {}
        self.param = _first(names, _PAST + _CACHE if protocol == "hf" else _CACHE)
        self.start_pos = START in names and protocol == "buffers"
        self._cache = None
        self._pos = 0
        #: the sizes of the axes of every tensor the cache holds, after the prompt and after
        #: each step (see :meth:`overfull`)
        self._sizes: list[list[tuple[int, ...]]] = []
        #: the steps that handed back the very cache they were handed, every tensor of it
        #: unchanged (see :meth:`stale`)
        self._unchanged: list[int] = []

    def _at(self, ids: torch.Tensor, pos: int) -> dict:
        """``start_pos=pos`` where the caller keeps the position, and the position moved on."""
        self._pos = pos + ids.shape[1]
        return {START: pos} if self.start_pos else {}

    def full(self, ids: torch.Tensor):
        if self.protocol == "hf":
            return self.model(ids, **self.off)
        self._reset()
        return self.model(ids, **self._at(ids, 0))

    def start(self, ids: torch.Tensor):
        if self.protocol == "hf":
            out = self.model(ids, **self.on)
            self._cache = _returned_cache(out)
            if self._cache is None:
                raise _NoCache("the prompt with use_cache=True returned no cache")
            self._sizes = [_sizes(self._cache)]
            return out
        self._reset()
        if self.protocol == "buffers":
            return self.model(ids, **self.on, **self._at(ids, 0))
        self._cache = make_cache(self.model, self.layers)
        out = self.model(ids, **{self.param: self._cache}, **self.on)
        self._sizes = [_sizes(self._cache)]
        return out

    def step(self, ids: torch.Tensor):
        if self.protocol == "hf":
            handed = [t.clone() for t in _held(self._cache)]
            out = self.model(ids, **{self.param: self._cache}, **self.on)
            self._cache = _returned_cache(out)
            if self._cache is None:
                raise _NoCache("a step with use_cache=True returned no cache")
            back = _held(self._cache)
            same = len(back) == len(handed) and all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(handed, back, strict=False)
            )
            if handed and same:
                self._unchanged.append(len(self._sizes) - 1)
            self._sizes.append(_sizes(self._cache))
            return out
        if self.protocol == "buffers":
            return self.model(ids, **self.on, **self._at(ids, self._pos))
        out = self.model(ids, **{self.param: self._cache}, **self.on)
        self._sizes.append(_sizes(self._cache))
        return out

    def overfull(self, prompt: int) -> int | None:
        """The entries the cache holds along its tokens' axis after the last step, where
        that is more than the tokens fed (``prompt`` and one a step): the cache updated
        more than once for a token; else None. The tokens' axes are those of the size of
        the prompt after it that grew at the first step (a static cache's slots do not)."""
        if len(self._sizes) < 2 or len({len(s) for s in self._sizes}) != 1:
            return None
        first, second, last = self._sizes[0], self._sizes[1], self._sizes[-1]
        fed = prompt + len(self._sizes) - 1
        for a, b, z in zip(first, second, last, strict=True):
            if not (len(a) == len(b) == len(z)):
                return None
            for axis, size in enumerate(a):
                if size == prompt and b[axis] > size and z[axis] > fed:
                    return z[axis]
        return None

    def stale(self, prompt: int, step: int) -> str | None:
        """Why the cache a diverging ``step`` read is stale, read from its sizes and
        contents alone: more entries than tokens (:meth:`overfull`), or an earlier step
        that handed back the very cache it was handed, nothing of its token stored
        (GluonNLP's states returned as they came); else None."""
        held = self.overfull(prompt)
        if held is not None:
            return (
                f"the cache holds {held} entries along its tokens' axis after "
                f"{prompt + step + 1} tokens: it was updated more than once for a token"
            )
        kept = next((t for t in self._unchanged if t < step), None)
        if kept is not None:
            return (
                f"step {kept} handed back the cache it was handed, unchanged: its token's key "
                "and value were never stored"
            )
        return None

    def _reset(self) -> None:
        reset = _reset_method(self.model)
        if reset is not None:
            reset()
        if hasattr(self.model, "current_pos"):
            self.model.current_pos = 0


class _NoCache(RuntimeError):
    """A Hugging Face-style call that returned no cache to pass back."""


def _held(cache, depth: int = 0) -> list[torch.Tensor]:
    """The tensors a cache holds, in a fixed order (tuples, lists, dicts and plain objects
    walked a few levels deep)."""
    if isinstance(cache, torch.Tensor):
        return [cache]
    if depth > 4:
        return []
    if isinstance(cache, Mapping):
        items = list(cache.values())
    elif isinstance(cache, (tuple, list)):
        items = list(cache)
    elif hasattr(cache, "__dict__") and not isinstance(cache, nn.Module):
        items = list(vars(cache).values())
    else:
        return []
    return [t for item in items for t in _held(item, depth + 1)]


def _sizes(cache) -> list[tuple[int, ...]]:
    """The shapes of the tensors a cache holds (see :func:`_held`)."""
    return [tuple(t.shape) for t in _held(cache)]


def _returned_cache(out):
    """The cache a Hugging Face-style call returned: ``past_key_values`` (or ``presents``,
    ...) of an output object or a dict, or, from a tuple (``return_dict=False``, or a model
    written by hand), the first item after the output that is not a tensor."""
    for name in ("cache", "past_key_values", "presents", "past_kv", "past", "kv_cache"):
        cache = out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)
        if cache is not None:
            return cache
    if isinstance(out, (tuple, list)):
        for item in out[1:]:
            if item is not None and not isinstance(item, torch.Tensor):
                return item
    return None


def _cache_like(obj, methods: tuple[str, ...] = ("get", "update"), mapping: bool = False) -> bool:
    """A class with ``methods`` made from a layer count alone; a mapping only where
    ``mapping`` (a dict's own ``get`` and ``update`` are not the book's per-layer ones, but
    a dict subclass the model's code defines as its cache is its cache: fairseq's
    ``incremental_state``)."""
    if (
        not isinstance(obj, type)
        or issubclass(obj, nn.Module)
        or (issubclass(obj, Mapping) and not mapping)
        or not all(callable(getattr(obj, m, None)) for m in methods)
    ):
        return False
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return len(required) <= 1 and bool(params)


def _cache_class(model: nn.Module, layers: int | None = None) -> type | None:
    """The KVCache class the model comes with: one on the model's class, or one its module
    defines or imports (a class named for a cache, made from a layer count alone; one with
    the book's ``get`` and ``update`` first, else one the module itself defines, whatever
    its methods: nanochat's ``insert_kv`` and ``get_pos``). Nothing is imported to find it."""
    for name in dir(type(model)):
        if "cache" in name.lower() and _cache_like(getattr(type(model), name, None)):
            return getattr(type(model), name)
    module = sys.modules.get(type(model).__module__)
    names = dict(vars(module)) if module is not None else {}
    names.update(getattr(type(model).forward, "__globals__", {}))
    named = [v for v in names.values() if isinstance(v, type) and "cache" in v.__name__.lower()]
    found = [v for v in named if _cache_like(v)]
    # a cache class of the model's own code (not one it imports) is its cache, with any API
    # (a dict subclass among them: fairseq's incremental_state, keyed by the model itself)
    found += [
        v
        for v in named
        if _cache_like(v, (), mapping=True) and v.__module__ == type(model).__module__
    ]
    return found[0] if found else _used_cache_class(model, layers)


#: per model, the class of its own module it was seen to use as its cache (see below)
_USED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _new_cache(cls: type, n: int):
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    if "n_layers" in params:
        return cls(n_layers=n)
    return cls(n) if params else cls()


def _state(obj) -> object:
    """What a call can change of an object, shallowly: its items, or its attributes (each
    by identity, with the length of a container and the value of a number)."""

    def of(v):
        size = len(v) if isinstance(v, (Mapping, list, tuple, set)) else None
        return (id(v), size, v if isinstance(v, (int, float, bool)) else None)

    if isinstance(obj, Mapping):
        return {k: of(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [of(v) for v in obj]
    return {k: of(v) for k, v in vars(obj).items()} if hasattr(obj, "__dict__") else None


def _used_cache_class(model: nn.Module, layers: int | None = None) -> type | None:
    """A class of the model's own module (not one it imports) that the model uses as its
    cache, whatever it is named and whatever its methods (flash-attention's
    ``InferenceParams``): made from a layer count alone, passed as the forward's ``cache=``
    on a short prompt, the call runs and writes into it. Read from what the model does; a
    name that speaks of a cache only orders the candidates."""
    if model in _USED:
        return _USED[model]
    param = _first(_params(model), _CACHE)
    module = sys.modules.get(type(model).__module__)
    own = [
        v
        for v in (vars(module).items() if module is not None and param else ())
        if isinstance(v[1], type)
        and v[1].__module__ == type(model).__module__
        and not issubclass(v[1], BaseException)
        and _cache_like(v[1], (), mapping=True)
    ]
    own.sort(key=lambda kv: not ("cache" in kv[0].lower() or "cache" in kv[1].__name__.lower()))
    n = layers or max([len(m) for m in model.modules() if isinstance(m, nn.ModuleList)] or [1])
    ids = torch.zeros(2, 3, dtype=torch.long)  # id 0 is in every vocabulary
    on = {"use_cache": True} if "use_cache" in _params(model) else {}
    used = None
    for cls in dict.fromkeys(c for _, c in own):
        if used is not None:
            break
        try:
            cache = _new_cache(cls, n)
            before = _state(cache)
            with torch.no_grad():
                model(ids, **{param: cache}, **on)
            if before is not None and _state(cache) != before:
                used = cls
        except Exception:  # noqa: BLE001,S112  (not its cache)
            continue
        finally:
            _Driver(model, 0, "cache")._reset()
    _USED[model] = used
    return used


class KVCache:
    """The book's ``KVCache`` interface, for a model that takes ``cache=`` and comes with no
    cache class of its own: one slot per layer, ``get``, ``update``, ``get_all``, ``reset``;
    also indexed like the list of per-layer slots it holds."""

    def __init__(self, n_layers: int):
        self.cache = [None] * n_layers

    def get(self, layer_idx: int):
        return self.cache[layer_idx]

    def update(self, layer_idx: int, value) -> None:
        self.cache[layer_idx] = value

    def get_all(self) -> list:
        return self.cache

    def reset(self) -> None:
        self.cache = [None] * len(self.cache)

    def __getitem__(self, layer_idx: int):
        return self.cache[layer_idx]

    def __setitem__(self, layer_idx: int, value) -> None:
        self.cache[layer_idx] = value

    def __len__(self) -> int:
        return len(self.cache)


def make_cache(model: nn.Module, layers: int):
    """A cache for a model that takes ``cache=``: the class it comes with (its own, or its
    module's); the book's ``llms_from_scratch`` KVCache for a model from that package; else
    :class:`KVCache` (the same interface). Sized by the model's ``cfg["n_layers"]`` where it
    has one, else by the attention layers it runs."""
    cls = _cache_class(model, layers)
    if cls is None and type(model).__module__.startswith("llms_from_scratch"):
        try:
            from llms_from_scratch.kv_cache.utils import KVCache as cls  # noqa: N813
        except ImportError:
            cls = None
    cls = cls or KVCache
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, dict) and "n_layers" in cfg:
        n = cfg["n_layers"]
    else:  # the attention layers it runs, or its longest stack of blocks, if longer: a
        # slot too many is never read, one too few breaks the model inside its own cache
        stacks = [len(m) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
        n = max([layers, *stacks])
    return _new_cache(cls, n)


def _output(result) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        t = result.get(name) if isinstance(result, Mapping) else getattr(result, name, None)
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

    def unfinished(self) -> str | None:
        """The attention layer a call raised in: entered and never left (None: the call
        raised outside every attention layer)."""
        for path, _ in self.layers:
            if "args" in self.seen.get(path, {}) and "out" not in self.seen[path]:
                return path
        return None


def _raised(exc: BaseException) -> str:
    """``TypeError: ... (at file:line)``: the exception and the innermost line of the model's
    own code (not torch's) it came from."""
    where = _raised_at(exc)
    text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return text + (f" (at {where})" if where else "")


def _raised_at(exc: BaseException) -> str | None:
    """The innermost line of the model's own code an exception came from."""
    where = None
    tb = exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith((_TORCH_DIR, _OWN_DIR)):
            where = f"{short_path(path)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def _not_our_cache(drive: _Driver, exc: BaseException) -> None:
    """Raise (exit 2) where the model asked attnscope's stand-in :class:`KVCache` for what
    it does not have: the model expects a cache of another interface, which is no mistake
    of the model's."""
    ours = drive._cache
    if isinstance(ours, KVCache) and _inside(ours, exc):
        raise AttnScopeError(
            f"--decode cache: expected the model to use a cache with get/update (the book's "
            f"KVCache; it names no cache class of its own), got a model that uses it another "
            f"way: {_raised(exc)}: check it with --decode none, or give it its cache class "
            "in its module"
        ) from None
    if isinstance(ours, KVCache) and isinstance(exc, AttributeError) and exc.obj is ours:
        raise AttnScopeError(
            f"--decode cache: expected the model to use a cache with get/update (the book's "
            f"KVCache; it names no cache class of its own), got a model that calls "
            f"cache.{exc.name} ({_raised_at(exc) or 'in its forward'}): check it with "
            "--decode none, or give it its cache class in its module"
        ) from None


def _inside(ours: KVCache, exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside one of the stand-in cache's own methods (indexed by
    a key it does not have, a layer index out of range, ...): the model's cache has another
    interface, which is no mistake of the model's."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_next is None:
            return tb.tb_frame.f_locals.get("self") is ours
        tb = tb.tb_next
    return False


def check_decoding(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    ids: torch.Tensor,
    protocol: str | None = None,
) -> Decode | None:
    """Cached decoding of ``ids`` ``(B, PROMPT + STEPS)`` against the full pass, or None where
    the model has no cache the checker knows how to drive (or ``protocol`` is ``none``)."""
    protocol = decode_protocol(model, protocol, ids[:, :PROMPT])
    if protocol in (None, "none"):
        return None
    drive = _Driver(model, len(layers), protocol)
    with torch.no_grad():
        with _Taps(layers) as full_taps:
            try:
                full = _output(drive.full(ids)).double()
            except Exception as exc:  # noqa: BLE001
                return Decode(
                    False,
                    STEPS,
                    0,
                    full_taps.unfinished(),
                    "cache_other",
                    f"the full pass, driven as {protocol!r}, raised {_raised(exc)}",
                    protocol,
                    _raised_at(exc),
                )
        # a model that returns its last position alone: its layers are held, not its output
        whole = full.dim() >= 2 and full.shape[1] == ids.shape[1]
        reference = {p: full_taps.seen[p] for p, _ in layers if p in full_taps.seen}
        try:
            drive.start(ids[:, :PROMPT])
        except Exception as exc:  # noqa: BLE001  (the model's own error, reported)
            _not_our_cache(drive, exc)
            where = _raised_at(exc)
            return Decode(
                False,
                STEPS,
                0,
                None,
                "cache_other",
                f"the prompt with the cache raised {_raised(exc)}",
                protocol,
                where,
            )
        for t in range(STEPS):
            pos = PROMPT + t
            with _Taps(layers) as taps:
                try:
                    out = _output(drive.step(ids[:, pos : pos + 1])).double()
                except Exception as exc:  # noqa: BLE001
                    _not_our_cache(drive, exc)
                    return Decode(
                        False,
                        STEPS,
                        t,
                        taps.unfinished(),
                        "cache_other",
                        f"step {t} raised {_raised(exc)}",
                        protocol,
                        _raised_at(exc),
                    )
            for i, (path, _) in enumerate(layers):
                got, want = taps.seen.get(path), reference.get(path)
                if got is None or want is None or "out" not in got:
                    continue
                if close(*_new_token(got["out"], want["out"], pos, ids.shape[1])):
                    continue
                evidence = _Evidence(model, layers, protocol, ids, path, t)
                code, why, where = _name(got, want, pos, t, i == 0, evidence, ids.shape[1])
                stale = drive.stale(PROMPT, t)
                if stale is not None and code in ("cache_positions", "cache_other"):
                    # what moved the token is the cache itself, and whatever follows from its
                    # length (a position) is off by as much
                    code, where = "cache_stale", None
                    why = f"{stale} (what follows from its length, a position, is off too: {why})"
                seen = f"its output for the new token differs from the full pass: {why}"
                if code == "cache_other" and t > 0:
                    earlier = _already_held(evidence, t)
                    if earlier is not None:
                        first, (code, why, where) = earlier
                        seen = (
                            f"{why}; its output for the new token stays within float32 error "
                            f"of the full pass until step {t} (token {pos})"
                        )
                        t, pos = first, PROMPT + first
                return Decode(
                    False,
                    STEPS,
                    t,
                    path,
                    code,
                    f"step {t} (token {pos}), layer {path!r}: {seen}",
                    protocol,
                    where,
                )
            if whole and not close(out[:, -1:], full[:, pos : pos + 1]):
                return Decode(
                    False,
                    STEPS,
                    t,
                    None,
                    "cache_other",
                    f"step {t} (token {pos}): the model's output differs from the full pass "
                    "while every attention layer's agrees",
                    protocol,
                )
    return Decode(True, STEPS, protocol=protocol)


class _Evidence:
    """The keys and values the first diverging layer attends over at the diverging step,
    against those of the full pass: read from the recorded computation (the operands of its
    scores and context products, or of its fused attention call) of a second, identical
    run, made only when a step diverges."""

    def __init__(self, model, layers, protocol, ids, path, step):
        self.model, self.layers, self.protocol = model, layers, protocol
        self.ids, self.path, self.step = ids, path, step
        self._read = False
        self.full = self.cached = None
        self.cache_seen = False
        self.made_before: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []  # what the cache keeps after the step
        #: the line where the step's queries meet keys made without the new token (the
        #: cached keys scored apart from the new one, or a cache read with nothing of this
        #: step written into it), or None
        self.apart: str | None = None
        #: the weights (softmax outputs) of the full pass and of the cached step, or None
        self.weights: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def operands(self):
        """``((keys, values, where), (keys, values, where))``: full pass, cached step; None
        where they cannot be read."""
        if not self._read:
            self._read = True
            try:
                self.full, self.cached = self._record()
            except Exception:  # noqa: BLE001  (no evidence: the step's rule names it)
                self.full = self.cached = None
        if self.full is None or self.cached is None:
            return None
        return self.full, self.cached

    def _record(self):
        drive = _Driver(self.model, len(self.layers), self.protocol)
        ids = self.ids.clone()
        rec = Recorder({id(ids): "input:0"}, self.model)
        with rec:
            drive.full(ids)
        full = _layer_operands(rec, self.model, self.path)
        full_weights = _softmax_in(rec, self.path)
        drive.start(self.ids[:, :PROMPT])
        for t in range(self.step):
            drive.step(self.ids[:, PROMPT + t : PROMPT + t + 1])
        pos = PROMPT + self.step
        new = self.ids[:, pos : pos + 1].clone()
        rec = Recorder({id(new): "input:0"}, self.model)
        with rec:
            drive.step(new)
        self.cache_seen = _cache_seen(rec, self.model, pos)
        self.made_before = _made_before(rec, self.model)
        self.kept = _kept(drive, self.model)
        self.apart = _scores_of_unwritten_keys(rec, self.path)
        self.weights = full_weights, _softmax_in(rec, self.path)
        return full, _layer_operands(rec, self.model, self.path)


def _kept(drive: _Driver, model: nn.Module) -> list[torch.Tensor]:
    """The floating tensors the decoding keeps between steps: those the cache object holds
    (its lists, dicts and attributes, a few levels down), or, for a model that keeps its
    own, its buffers and the tensors its modules hold as attributes."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj, depth: int) -> None:
        if id(obj) in seen or depth > 5 or len(out) > 4096:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and obj.dim() >= 2:
                out.append(obj)
        elif isinstance(obj, Mapping):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
            for v in vars(obj).values():
                walk(v, depth + 1)

    if drive._cache is not None:
        walk(drive._cache, 0)
    else:
        params = {id(p) for p in model.parameters()}
        for m in model.modules():
            # its buffers and plain attributes (not torch's own registries of parameters
            # and submodules)
            held = [v for k, v in vars(m).items() if not k.startswith("_")]
            for v in [*m._buffers.values(), *held]:
                if id(v) not in params:
                    walk(v, 1)
    return out


def _cache_seen(rec: Recorder, model: nn.Module, cached: int) -> bool:
    """Whether the step read a cache holding ``cached`` tokens: a tensor made before it
    (not a parameter) with three axes or more, one of them ``cached`` long."""
    params = {p.data_ptr() for p in model.parameters()}
    for op in rec.ops:
        t = op.output
        if op.args or not op.name.startswith("input of") or not t.is_floating_point():
            continue
        if t.dim() >= 3 and cached in t.shape and t.data_ptr() not in params:
            return True
    return False


def _made_before(rec: Recorder, model: nn.Module) -> list[torch.Tensor]:
    """The tensors the step read (or wrote into) that were made before it, not parameters:
    where a cache it touches lives (a paged pool, a preallocated buffer)."""
    params = {p.data_ptr() for p in model.parameters()}
    return [
        op.output
        for op in rec.ops
        if not op.args
        and op.name.startswith("input of")
        and isinstance(op.output, torch.Tensor)
        and op.output.is_floating_point()
        and op.output.dim() >= 2
        and op.output.data_ptr() not in params
    ]


def _cache_holds(
    made_before: list[torch.Tensor],
    full_keys: torch.Tensor,
    axis: int | None,
    pos: int,
    tokens: list[int] | None = None,
) -> bool:
    """Whether the tensors the step touched (or the cache keeps) hold the full pass's key of
    every token before ``pos`` (or of ``tokens``; of its first batch row and head, in any
    layout whose last axis runs over a head's features): the cache holds the earlier keys,
    whether the step attends to them or not."""
    if axis is None or pos == 0:
        return False
    if axis == full_keys.dim() - 1:  # keys transposed for the product
        full_keys, axis = full_keys.transpose(-1, -2), axis - 1
    if full_keys.shape[axis] < pos:
        return False
    rows = full_keys.movedim(axis, 0).double()
    hd = rows.shape[-1]
    want = [rows[j].reshape(-1, hd)[0] for j in (range(pos) if tokens is None else tokens)]
    least = pos * hd if tokens is None else hd  # a page of a paged cache holds a few
    pools = [
        t.detach().double().reshape(-1, hd)
        for t in made_before
        if t.shape[-1] % hd == 0 and t.numel() >= least
    ]
    if not pools:
        return False
    for w in want:
        scale = float(w.abs().amax()) or 1.0
        if not any(bool(((p - w).abs().amax(dim=-1) <= 1e-4 * scale + 1e-6).any()) for p in pools):
            return False
    return True


def _layer_operands(rec: Recorder, model: nn.Module, path: str):
    """The keys and values (as the computation used them) of the first attention core run
    inside the module ``path``, the lines that made the keys, masked the scores and made
    the queries, and the queries; None if none is found."""
    from .structure import attention_cores

    cores = attention_cores(rec, model)
    spans = [c for c in rec.modules if c.path == path]
    for core in cores:
        op = core.fused or core.score
        if op is None or core.v_node is None:
            continue
        span = next((c for c in spans if c.start <= op.index < c.end), None)
        if span is not None:
            q, k, v = (rec.ops[n] for n in (core.q_node, core.k_node, core.v_node))
            lines = (k.location, _mask_line(rec, op, span), q.location)
            return k.output.detach(), v.output.detach(), lines, q.output.detach()
    found = _one_query_core(rec, spans[0]) if spans else None
    if found is None:
        return None
    score, q, k, v = found
    lines = (k.location, _mask_line(rec, score, spans[0]), q.location)
    return k.output.detach(), v.output.detach(), lines, q.output.detach()


#: the calls that turn scores into weights
_SOFTMAX = ("softmax", "_softmax")


def _one_query_core(rec: Recorder, span) -> tuple[Op, Op, Op, Op] | None:
    """``(score product, queries, keys, values)`` of a step's attention written for one
    query, with no query axis (fast-transformers' recurrent attention: ``einsum("nhe,nhse->
    nhs")``, a softmax over the keys, then ``einsum("nhs,nhsd->nhd")``), which no
    token-by-token core describes: a product whose output reaches a softmax, and the first
    product after it that reads the weights; the keys are the larger operand, and have an
    axis more than the scores (the queries' own)."""
    for op in rec.ops[span.start : span.end]:
        if op.name not in MATMULS:
            continue
        pair = [a for a in op.args if rec.ops[a].output.is_floating_point()]
        if len(pair) != 2:
            continue
        reach, softmaxed = {op.index}, False
        for nxt in rec.ops[op.index + 1 : span.end]:
            if not any(a in reach for a in nxt.args):
                continue
            if softmaxed and nxt.name in MATMULS:
                others = [a for a in nxt.args if a not in reach]
                if len(others) != 1:
                    break
                q, k = sorted(pair, key=lambda a: rec.ops[a].output.numel())
                if op.output.dim() >= rec.ops[k].output.dim():
                    break  # scores with a query axis: a core, where one is read at all
                return op, rec.ops[q], rec.ops[k], rec.ops[others[0]]
            reach.add(nxt.index)
            softmaxed = softmaxed or nxt.name in _SOFTMAX
    return None


def _scores_of_unwritten_keys(rec: Recorder, path: str) -> str | None:
    """The line of a product inside the layer ``path`` whose one operand is made from the
    step's token (its queries) and whose other is not (keys read from a cache that nothing
    of this step reached: the new token's key and value not written, or written to a copy;
    or the cached keys scored apart from the new one, as NxDI's token generation does), on
    the way to a softmax (or the ``exp`` of one written out); None where there is none."""
    g = Graph(rec)
    spans = [c for c in rec.modules if c.path == path]
    if not spans:
        return None
    span = spans[0]
    for op in rec.ops[span.start : span.end]:
        if op.name not in MATMULS:
            continue
        tensors = [a for a in op.args if rec.ops[a].output.is_floating_point()]
        if len(tensors) != 2 or g.tainted[tensors[0]] == g.tainted[tensors[1]]:
            continue
        other = next(a for a in tensors if not g.tainted[a])
        if g.param[other] or rec.ops[other].output.dim() < 3:
            continue  # a weight, not keys
        later = rec.ops[op.index + 1 : span.end]
        reach = {op.index}
        for nxt in later:
            if any(a in reach for a in nxt.args):
                reach.add(nxt.index)
                if nxt.name in ("softmax", "_softmax", "log_softmax", "exp"):
                    return op.location
    return None


def _mask_line(rec: Recorder, score: Op, span) -> str | None:
    """Where the layer masks its scores: the first masking call made from them inside the
    layer (the fused call itself, or the scores product, where there is none)."""
    from .features import MASKING_OPS

    if score.name == "scaled_dot_product_attention":
        return score.location
    made = {score.index}
    for op in rec.ops[score.index + 1 : span.end]:
        if any(a in made for a in op.args):
            made.add(op.index)
            if op.name in MASKING_OPS and op.location:
                return op.location
    return score.location


def _token_axis(step: torch.Tensor, full: torch.Tensor, keys: int | None = None) -> int | None:
    """The axis of ``step`` that runs over the keys: the one whose size differs from the
    full pass's; where none does (a preallocated cache as long in both), the last but one,
    or the last where only it is ``keys`` long (keys transposed for the product)."""
    if step.dim() != full.dim() or step.dim() < 2:
        return None
    differ = [i for i in range(step.dim()) if step.shape[i] != full.shape[i]]
    if len(differ) > 1:
        return None
    if differ:
        return differ[0]
    if keys is not None and step.shape[-2] != keys and step.shape[-1] == keys:
        return step.dim() - 1
    return step.dim() - 2


def _rows(
    step: torch.Tensor, full: torch.Tensor, pos: int, keys: int | None = None
) -> list[int | str | None] | None:
    """For each token row the cached step attends over, the full pass's token it equals
    (``"empty"`` for a row of zeros, ``"later"`` for a token after ``pos``, None for none);
    None when the layouts do not match."""
    axis = _token_axis(step, full, keys)
    if axis is None:
        # the step's path lays its keys out otherwise (fast-transformers' recurrent
        # attention: (n, heads, keys, e) where its batch path has (n, keys, heads, e)):
        # the order of the other axes that finds the most of the full pass's tokens
        best = None
        if step.dim() == full.dim() and 2 <= step.dim() <= 5:
            for order in itertools.permutations(range(step.dim())):
                moved = step.permute(order)
                if _token_axis(moved, full, keys) is None or order == tuple(range(step.dim())):
                    continue
                got = _rows(moved, full, pos, keys)
                found = sum(isinstance(j, int) for j in got or [])
                if got is not None and (best is None or found > best[0]):
                    best = found, got
        return None if best is None or best[0] == 0 else best[1]
    s = step.movedim(axis, 0).reshape(step.shape[axis], -1).double()
    f = full.movedim(axis, 0).reshape(full.shape[axis], -1).double()
    out: list[int | str | None] = []
    for row in s:
        if not bool(row.abs().amax() > 0):
            out.append("empty")
            continue
        j = next((j for j in range(f.shape[0]) if close(row, f[j])), None)
        out.append("later" if j is not None and j > pos else j)
    return out


def _same_query(step: torch.Tensor, full: torch.Tensor, pos: int) -> bool:
    """Whether the step's query is the full pass's at ``pos`` (True where the layouts do not
    say: no evidence against it)."""
    axis = _token_axis(step, full)
    if axis is None or step.shape[axis] != 1 or full.shape[axis] <= pos:
        return True
    return close(step.double(), full.narrow(axis, pos, 1).double())


def _same_length(step: torch.Tensor, full: torch.Tensor, pos: int, values: list) -> bool:
    """Whether the step's key for the new token (the row holding token ``pos``'s value) is as
    long as the full pass's key at ``pos``: a rotation, for whatever position, keeps each
    head's length; a key made otherwise (a norm skipped) does not. True where the layouts
    do not say."""
    axis = _token_axis(step, full, len(values))
    if axis is None or pos not in values:
        return True
    row = step.movedim(axis, 0)[values.index(pos)].double()
    want = full.movedim(axis, 0)[pos].double()
    if row.numel() != want.numel():
        return True
    a, b = row.norm().item(), want.norm().item()
    return abs(a - b) <= 1e-4 * max(b, 1e-12)


def _already_held(evidence: _Evidence, step: int):
    """``(earlier step, (code, why, where))`` where what the diverging step attends over
    holds an entry that is no token's in the full pass, and the step that first read that
    entry already held it (a cache kept in a lower precision: its rounding shows in the
    outputs only steps later); None otherwise. Row ``j`` of the cache is read from step
    ``j - PROMPT`` on (the prompt's rows from step 0)."""
    got = evidence.operands()
    if got is None:
        return None
    (fk, fv, _, _), (ck, cv, _, _) = got
    pos = PROMPT + step
    values = _rows(cv, fv, pos)
    if values is None:
        return None
    keys = _rows(ck, fk, pos, len(values)) or []
    unknown = [j for j, v in enumerate(values) if v is None]
    unknown += [j for j, k in enumerate(keys) if k is None]
    if not unknown or min(unknown) >= pos:
        return None  # only the new token's own entry: this step's making
    earlier = max(0, min(unknown) - PROMPT)
    if earlier >= step:
        return None
    before = _Evidence(
        evidence.model, evidence.layers, evidence.protocol, evidence.ids, evidence.path, earlier
    )
    named = _from_rows(before, PROMPT + earlier, earlier)
    if named is None or named[0] != "cache_other":
        return None
    return earlier, named


def _tokens(ts) -> str:
    ts = sorted(set(ts))
    return ", ".join(map(str, ts[:6])) + (", ..." if len(ts) > 6 else "")


def _from_rows(evidence: _Evidence, pos: int, step: int):
    """``(code, why, where)`` from what the cached step attends over, or None."""
    got = evidence.operands()
    if got is None:
        return None
    (fk, fv, _, fq), (ck, cv, (k_line, score_line, q_line), cq) = got
    values = _rows(cv, fv, pos)
    if values is None:
        return None
    keys = _rows(ck, fk, pos, len(values))
    want = list(range(pos + 1))
    held = [j for j in values if isinstance(j, int)]
    twice = sorted({j for j in held if held.count(j) > 1})
    empty = values.count("empty")
    unknown = values.count(None)
    if twice:
        return (
            "cache_stale",
            f"it attends over {len(values)} keys and values for {pos + 1} tokens: "
            f"those of token(s) {_tokens(twice)} are held twice (the cache updated twice)",
            k_line,
        )
    missing = [j for j in want if j not in held]
    if unknown:
        return (
            "cache_other",
            f"{unknown} of the {len(values)} values it attends over are no token's value in "
            "the full pass: the cache holds something else (another layout, precision or "
            "sequence?)",
            k_line,
        )
    holds = held == [pos] and (
        evidence.cache_seen or _cache_holds(evidence.made_before, fk, _token_axis(ck, fk, 1), pos)
    )
    if missing and held == [pos] and evidence.apart is not None:
        return (
            "cache_mask",
            "the new token's own key is scored apart from the cached ones (at "
            f"{evidence.apart}), and with the same input its output differs from the full "
            "pass: the mask over the cached keys shows it too many or too few",
            evidence.apart,
        )
    if missing and holds:
        return (
            "cache_mask",
            "the new token sees its own key and value alone, none of the cached ones "
            + ("(which the step reads)" if evidence.cache_seen else "(which the cache holds)"),
            score_line,
        )
    if missing and held == [pos]:
        return (
            "cache_stale",
            f"the new token sees its own key and value alone: the step reads no cache of "
            f"the {pos} tokens before it (the cache not updated)",
            k_line,
        )
    axis = _token_axis(ck, fk, len(values))
    if missing and _cache_holds(evidence.kept, fk, axis, pos, missing):
        return (
            "cache_mask",
            f"the keys of token(s) {_tokens(missing)} are in the cache and missing from what "
            "it attends over: the step does not read them (a page table, or a slice of the "
            "cache, that skips them?)",
            score_line,
        )
    if missing:
        return (
            "cache_stale",
            f"the keys and values of token(s) {_tokens(missing)} are missing from what it "
            "attends over (the cache not updated with them)",
            k_line,
        )
    # the values held are exactly the full pass's: the keys, then the mask
    if not _same_query(cq, fq, pos):
        return (
            "cache_positions",
            f"the keys and values it attends over are right and the new token's query is not "
            f"the full pass's query for position {pos} (rotated for another position?)",
            q_line,
        )
    if keys is not None and keys.count(None):
        cached_ok = all(j is not None for j, v in zip(keys, values, strict=False) if v != pos)
        if cached_ok and not _same_length(ck, fk, pos, values):
            return (
                "cache_other",
                f"the cached keys are right and the new token's key is not the full pass's "
                f"key for position {pos}, nor that key turned (its length differs: made "
                "otherwise on the decoding path, a norm skipped?)",
                k_line,
            )
        if cached_ok:
            return (
                "cache_positions",
                f"the cached keys are right and the new token's key is not the full pass's "
                f"key for position {pos} (rotated for another position?)",
                k_line,
            )
        wrong = [j for j, v in zip(keys, values, strict=False) if j is None and v != pos]
        return (
            "cache_other",
            f"the values it attends over are right, and {len(wrong)} of the cached keys are no "
            "token's key in the full pass: the cache holds keys made otherwise (stored before "
            "the rotation, or in another layout?)",
            k_line,
        )
    later = values.count("later")
    if empty or later:
        what = " and ".join(
            w
            for w, n in ((f"{empty} empty slots", empty), (f"{later} slots of later tokens", later))
            if n
        )
        return (
            "cache_mask",
            f"its keys and values for tokens 0..{pos} are right, and {what} of the cache are "
            "not masked: the new token sees too many",
            score_line,
        )
    if _same_keys_seen(evidence, values, pos):
        return (
            "cache_other",
            f"the keys, values and query are the full pass's for tokens 0..{pos}, and it "
            "hides no key the full pass shows nor shows one it hides: it weighs them "
            "otherwise (its scores scaled or normalised otherwise on the decoding path?)",
            score_line,
        )
    return (
        "cache_mask",
        "the keys and values it attends over are the full pass's for tokens 0.."
        f"{pos}, and its output differs: the mask hides cached keys from the new token (or "
        "shows it others)",
        score_line,
    )


def _same_keys_seen(evidence: _Evidence, values: list, pos: int) -> bool:
    """Whether the step's weights hide from the new token exactly the tokens the full
    pass's hide from token ``pos`` (a weight of 0 in every sequence and head), the step's
    keys being the full pass's tokens ``values``; False where the weights cannot be read."""
    full, step = evidence.weights
    n = len(values)
    if full is None or step is None or step.shape[-1] != n or full.shape[-2] <= pos:
        return False
    if not all(isinstance(v, int) for v in values):
        return False
    if full.shape[-1] != full.shape[-2]:
        return False
    row = full.narrow(-2, pos, 1).reshape(-1, full.shape[-1])
    hidden_full = {j for j in range(pos + 1) if bool((row[:, j] == 0).all())}
    flat = step.reshape(-1, n)
    hidden_step = {values[i] for i in range(n) if bool((flat[:, i] == 0).all())}
    return hidden_full == hidden_step


def _softmax_in(rec: Recorder, path: str) -> torch.Tensor | None:
    """The output of the first softmax run inside the module ``path`` (its weights)."""
    span = next((c for c in rec.modules if c.path == path), None)
    if span is None:
        return None
    for op in rec.ops[span.start : span.end]:
        if op.name in _SOFTMAX and isinstance(op.output, torch.Tensor):
            return op.output.detach()
    return None


def _new_token(
    step: torch.Tensor, full: torch.Tensor, pos: int, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's tensor for the step's last token and the full pass's for token ``pos``,
    along the axis that runs over the tokens: the one ``total`` long in the full pass and
    shorter in the step, every other axis alike (tokens first, ``(T, B, d)``, as fairseq
    and ChatGLM run their layers, or batch first); the second axis where none is."""
    axis = None
    if step.dim() == full.dim() and step.dim() >= 2:
        for a in range(step.dim()):
            others = all(step.shape[i] == full.shape[i] for i in range(step.dim()) if i != a)
            if full.shape[a] == total and step.shape[a] < total and others:
                axis = a
                break
        rest = step.shape[1:] == full.shape[1:]
        if axis is None and rest and full.shape[0] % total == 0 and full.shape[0] > total:
            # an engine's flattened batch, (B * T, ...): each sequence's tokens in turn
            b = full.shape[0] // total
            if step.shape[0] % b == 0:
                step = step.reshape(b, step.shape[0] // b, *step.shape[1:])
                full = full.reshape(b, total, *full.shape[1:])
                axis = 1
    axis = 1 if axis is None else axis
    n = step.shape[axis]
    return step.narrow(axis, n - 1, 1).double(), full.narrow(axis, pos, 1).double()


def _name(
    got: dict,
    want: dict,
    pos: int,
    step: int,
    first_layer: bool,
    evidence: _Evidence,
    total: int,
) -> tuple[str, str, str | None]:
    """The mistake the evidence at the first diverging layer shows, a sentence, and the
    line to look at."""
    g_args, g_kwargs = got["args"]
    w_args, w_kwargs = want["args"]
    h_got, h_want = _hidden(g_args, g_kwargs), _hidden(w_args, w_kwargs)
    same_input = (
        h_got is not None and h_want is not None and close(*_new_token(h_got, h_want, pos, total))
    )
    if first_layer and not same_input:
        return (
            "cache_positions",
            "the new token reaches the first layer otherwise than in the full pass (its "
            "position embedding not offset by the cache length?)",
            None,
        )
    r_got, r_want = _rotary(g_kwargs), _rotary(w_kwargs)
    if r_got is not None and r_want is not None:
        cos_got, cos_want = r_got[0][..., -1:, :], r_want[0][..., pos : pos + 1, :]
        if cos_got.shape == cos_want.shape and not close(cos_got.double(), cos_want.double()):
            return (
                "cache_positions",
                "the layer is handed rotary tables for another position than the token's",
                None,
            )
    if same_input:
        named = _from_rows(evidence, pos, step)
        if named is not None:
            return named
    if same_input and evidence.apart is not None and evidence.operands() is None:
        # no product of the new token's query with its own key at all
        return (
            "cache_stale",
            "the new token's query meets only keys made without it: the step reads a cache "
            "that nothing of this step was written into (its key and value not stored, or "
            "stored in a copy?)",
            evidence.apart,
        )
    if same_input and step == 0:
        return (
            "cache_mask",
            "with the same input, the first cached step already differs: the new token does "
            "not see the cached keys as the full pass does",
            None,
        )
    if same_input:
        return (
            "cache_stale",
            f"steps 0..{step - 1} agree and step {step} does not: the cache was not updated "
            "(or was updated twice) after a step",
            None,
        )
    return "cache_other", "its input already differs, and no earlier layer explains it", None
