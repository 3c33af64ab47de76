"""Load a target (``file.py:NAME`` or ``pkg.module:NAME``), build it, infer its kind, call it.

Nothing in the user's code changes: a class is constructed from ``--init`` or from
constructor arguments inferred by name, with sizes that all differ from each other so
that confusions between them show (``sqrt(d_in)`` for ``sqrt(d_out)``, tokens for heads).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import AttnScopeError, describe
from ..stages import KINDS, Kind
from .record import short_path

__all__ = ["Target", "load", "SIZES", "call_safely"]

#: Constructor arguments that say how many heads (construction only: never a verdict).
HEAD_ATTRS = (
    "num_heads",
    "n_heads",
    "n_head",
    "num_attention_heads",
    "nhead",
    "heads",
    "h",
    "head_count",
)

#: Probe sizes for classes we construct: all different from each other.
SIZES = {"d_in": 10, "d_out": 12, "heads": 3, "head_dim": 4, "context": 9, "tokens": 7}

_ARG_GROUPS: dict[str, tuple[set[str], object]] = {
    "d_in": (
        {
            "d_in",
            "din",
            "in_dim",
            "input_dim",
            "in_features",
            "d_input",
            "dim_in",
            "input_size",
            "in_size",
            "in_channels",
        },
        SIZES["d_in"],
    ),
    "d_out": (
        {
            "d_out",
            "dout",
            "out_dim",
            "output_dim",
            "out_features",
            "d_output",
            "dim_out",
            "output_size",
            "out_size",
        },
        SIZES["d_out"],
    ),
    "model": (
        {
            "embed_dim",
            "dim",
            "d_model",
            "hidden_size",
            "n_embd",
            "emb_dim",
            "embedding_dim",
            "model_dim",
            "hidden_dim",
            "d_embed",
            "n_embed",
            "width",
            "hidden",
            "d",
            "embed_size",
            "emb_size",
            "d_hidden",
            "n_state",
            "channels",
        },
        SIZES["d_out"],
    ),
    "heads": (set(HEAD_ATTRS) | {"n_h", "num_head", "nheads"}, SIZES["heads"]),
    "head_dim": ({"head_dim", "d_head", "dim_head", "d_k", "dk", "head_size"}, SIZES["head_dim"]),
    "context": (
        {
            "context_length",
            "block_size",
            "max_len",
            "max_seq_len",
            "n_positions",
            "max_position_embeddings",
            "seq_len",
            "max_length",
            "ctx_len",
            "context_len",
            "max_seq_length",
            "n_ctx",
            "num_tokens",
            "max_tokens",
            "context_size",
            "max_seq",
        },
        SIZES["context"],
    ),
    "dropout": (
        {
            "dropout",
            "attn_drop",
            "p",
            "dropout_p",
            "attn_dropout",
            "proj_drop",
            "drop",
            "dropout_rate",
            "attn_pdrop",
            "resid_pdrop",
            "drop_rate",
            "attention_dropout",
        },
        0.0,
    ),
}
_FLAGS_BIAS = {"qkv_bias", "bias", "use_bias", "add_bias", "qkv_bias_enabled"}
_FLAGS_CAUSAL = {"causal", "is_causal", "masked", "use_mask", "mask", "autoregressive"}


@dataclass
class Target:
    """A loaded target: the module or function, how it was made, and its planned sizes."""

    obj: object
    text: str
    origin: str  # "instance", "factory", "class" or "function"
    init: dict | None = None
    notes: list[str] = field(default_factory=list)  # how it was made, for the report

    @property
    def is_module(self) -> bool:
        return isinstance(self.obj, nn.Module)


def _import_file(path: Path, timeout: float | None = None) -> object:
    name = f"_attnscope_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AttnScopeError(f"{path}: expected a Python file, could not load it")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        with _deadline(timeout):
            spec.loader.exec_module(module)
    except _PastDeadline as exc:
        raise AttnScopeError(f"{path}: importing it {exc}") from None
    except (Exception, SystemExit) as exc:  # the user's file raised while importing
        raise AttnScopeError(f"{path}: importing it raised {_exc_line(exc)}") from None
    finally:
        sys.path.pop(0)
    return module


def _exc_line(exc: BaseException) -> str:
    """``ValueError: message (at file.py:12)``, the innermost frame of the user's code."""
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"SyntaxError: {exc.msg} (at {short_path(exc.filename)}:{exc.lineno})"
    tb = traceback.extract_tb(exc.__traceback__)
    user = [f for f in tb if "/torch/" not in f.filename and "/attnscope/" not in f.filename]
    if user:
        where = f" (at {short_path(user[-1].filename)}:{user[-1].lineno})"
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}{where}"


def _resolve(text: str, timeout: float | None = None) -> object:
    if ":" not in text:
        raise AttnScopeError(
            f"target: expected path/to/file.py:NAME or package.module:NAME, got {text!r}"
        )
    where, _, attr = text.rpartition(":")
    if not attr:
        raise AttnScopeError(f"target: expected a NAME after ':', got {text!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise AttnScopeError(f"target: expected an existing Python file, got {where!r}")
        module = _import_file(path, timeout)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise AttnScopeError(f"target: could not import module {where!r}: {exc}") from None
        except (Exception, SystemExit) as exc:
            raise AttnScopeError(f"target: importing {where!r} raised {_exc_line(exc)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(
                n
                for n, v in vars(module).items()
                if not n.startswith("_")
                and (inspect.isclass(v) or inspect.isfunction(v) or isinstance(v, nn.Module))
                and getattr(v, "__module__", module.__name__) == module.__name__
            )
            raise AttnScopeError(
                f"target: {where!r} has no {attr!r}; it defines: {', '.join(names) or 'nothing'}"
            )
        obj = getattr(obj, part)
    return obj


def _required(fn: Callable) -> list[inspect.Parameter]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def infer_init(cls: type, kind: str | None, tokens: int | None = None) -> dict:
    """Constructor arguments from their names; sizes differ so that confusions show.

    A context length is chosen to hold ``tokens`` when a probe length is asked for.
    """
    kwargs: dict = {}
    sig = inspect.signature(cls.__init__)
    names = [n for n in sig.parameters if n != "self"]
    has_in_out = any(n in _ARG_GROUPS["d_in"][0] for n in names)
    for name, p in sig.parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        low = name.lower()
        value: object = inspect.Parameter.empty
        for group, (aliases, size) in _ARG_GROUPS.items():
            if low in aliases:
                value = size
                if group == "model" and has_in_out:
                    value = SIZES["d_out"]
                if group == "context" and tokens is not None:
                    value = max(SIZES["context"], tokens + 2)
                break
        if value is inspect.Parameter.empty and low in _FLAGS_BIAS:
            value = p.default if p.default is not inspect.Parameter.empty else False
        if value is inspect.Parameter.empty and low in _FLAGS_CAUSAL:
            if p.default is not inspect.Parameter.empty and kind is None:
                value = p.default
            else:
                value = kind is not None and Kind.of(kind).causal
        if value is inspect.Parameter.empty:
            if p.default is not inspect.Parameter.empty:
                continue
            raise AttnScopeError(
                f"{cls.__name__}: cannot infer constructor argument {name!r}; pass it with "
                f"--init '{{\"{name}\": ...}}' (expected names like d_in, d_out, num_heads, "
                "context_length, dropout)"
            )
        kwargs[name] = value
    return kwargs


def load(
    target: str | object,
    *,
    kind: str | None = None,
    init: dict | None = None,
    seed: int = 0,
    tokens: int | None = None,
    timeout: float | None = None,
) -> Target:
    """Load and build ``target``; see the module docstring for what it may be.

    ``tokens`` sizes an inferred context length; ``timeout`` bounds importing and building.
    """
    if kind is not None and kind not in KINDS:
        raise AttnScopeError(f"--kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if init is not None and not isinstance(init, dict):
        raise AttnScopeError(f"--init: expected a JSON object of keyword arguments, got {init!r}")
    text = (
        target
        if isinstance(target, str)
        else getattr(target, "__qualname__", None) or type(target).__name__
    )
    obj = _resolve(target, timeout) if isinstance(target, str) else target
    torch.manual_seed(seed)
    if isinstance(obj, nn.Module):
        if init:
            raise AttnScopeError("--init: expected a class, but the target is a module instance")
        return Target(obj, text, "instance")
    if inspect.isclass(obj):
        if not issubclass(obj, nn.Module):
            raise AttnScopeError(
                f"target: expected an nn.Module class, instance or function, got class "
                f"{obj.__name__}"
            )
        config_cls = _config_class(obj)
        made: list[str] = []
        if config_cls is not None:  # a Hugging Face layer: built from its config's defaults
            kwargs = {"config": _build_config(config_cls, init or {}, made)}
            kwargs.update(_layer_index(obj))
        else:
            kwargs = dict(init) if init is not None else infer_init(obj, kind, tokens)
        try:
            with _deadline(timeout):
                module = obj(**kwargs)
        except _PastDeadline as exc:
            raise AttnScopeError(f"{obj.__name__}({_kw(kwargs)}) {exc}") from None
        except (Exception, SystemExit) as exc:
            raise AttnScopeError(
                f"{obj.__name__}({_kw(kwargs)}) raised {_exc_line(exc)}; pass constructor "
                "arguments with --init '{...}'"
            ) from None
        return Target(module, text, "class", kwargs, made)
    if callable(obj):
        if init:
            raise AttnScopeError("--init: expected a class, but the target is a function")
        if not _required(obj) and (kind is None or Kind.of(kind).weighted):
            try:
                with _deadline(timeout):
                    made = obj()
            except _PastDeadline as exc:
                raise AttnScopeError(f"{text}() {exc}") from None
            except (Exception, SystemExit) as exc:
                raise AttnScopeError(f"{text}() raised {_exc_line(exc)}") from None
            if not isinstance(made, nn.Module):
                raise AttnScopeError(
                    f"{text}: a zero-argument callable must return an nn.Module, got "
                    f"{describe(made)}"
                )
            return Target(made, text, "factory")
        return Target(obj, text, "function")
    raise AttnScopeError(f"target: expected a module, class or function, got {describe(obj)}")


def _config_class(cls: type) -> type | None:
    """The Hugging Face config class a layer's constructor needs (``__init__(self, config,
    ...)``), from the parameter's annotation or the classes beside the layer's own."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if not params or params[0].name != "config" or params[0].default is not inspect.Parameter.empty:
        return None
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return None
    hint = params[0].annotation
    if isinstance(hint, str):  # postponed annotations: the name, looked up beside the class
        hint = vars(sys.modules.get(cls.__module__, object())).get(hint.split(".")[-1])
    if inspect.isclass(hint) and issubclass(hint, PretrainedConfig):
        return hint
    found = [
        v
        for v in vars(sys.modules.get(cls.__module__, object())).values()
        if inspect.isclass(v) and issubclass(v, PretrainedConfig) and v is not PretrainedConfig
    ]
    return found[0] if len(found) == 1 else None


def _layer_index(cls: type) -> dict:
    """A layer's index in its model (``layer_idx``), where its constructor requires one."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]
    return {
        p.name: 0
        for p in params
        if p.default is inspect.Parameter.empty
        and p.name in ("layer_idx", "layer_id", "layer_number")
    }


#: a config's defaults shrunk to this when they describe a big model (Llama's are 7B
#: parameters, 26 GB in float32): the checks do not depend on the size
_SMALL_CONFIG = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "n_inner": 128,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "vocab_size": 512,
}
_BIG = 5e7  # parameters, roughly: above this the defaults are shrunk (without --init)


def _build_config(config_cls: type, init: dict, notes: list[str] | None = None) -> object:
    """The config with its defaults, ``--init`` fields replacing them; without ``--init``,
    defaults that describe a big model are shrunk (said in ``notes``)."""
    try:
        config = config_cls(**init)
    except (Exception, SystemExit) as exc:
        raise AttnScopeError(
            f"{config_cls.__name__}({_kw(init)}) raised {_exc_line(exc)}; --init gives the "
            "config's fields for a layer built from a config"
        ) from None
    if init:
        return config
    width = next(
        (
            getattr(config, k)
            for k in ("hidden_size", "n_embd", "d_model")
            if isinstance(getattr(config, k, None), int)
        ),
        0,
    )
    layers = next(
        (
            getattr(config, k)
            for k in ("num_hidden_layers", "n_layer")
            if isinstance(getattr(config, k, None), int)
        ),
        1,
    )
    if 12 * width * width * max(layers, 1) <= _BIG:
        return config
    small = {k: v for k, v in _SMALL_CONFIG.items() if isinstance(getattr(config, k, None), int)}
    if "num_key_value_heads" in small and not getattr(config, "num_key_value_heads", None):
        small.pop("num_key_value_heads")
    try:
        config = config_cls(**small)
    except (Exception, SystemExit):
        return config_cls()
    if notes is not None:
        notes.append(
            f"built from {config_cls.__name__}'s defaults made small ({_kw(small)}): the "
            "checks do not depend on the size; --init sets the fields"
        )
    return config


def _kw(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


# ------------------------------------------------------------------------------ calling


class _PastDeadline(BaseException):
    """Raised into the target's code by the alarm; a BaseException, so that the target's
    own ``except Exception`` cannot swallow it, and not a TimeoutError, so that the
    target's own TimeoutError is not taken for ours."""


@contextlib.contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_PastDeadline` after ``seconds`` (main thread, where SIGALRM exists)."""
    usable = (
        seconds is not None
        and hasattr(signal, "SIGALRM")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise _PastDeadline(f"ran past --timeout {seconds:g}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def call_safely(fn: Callable, *args, timeout: float | None = None, **kwargs):
    """Call the user's code; return ``(result, None)`` or ``(None, "Error: msg (at f:l)")``."""
    try:
        with _deadline(timeout), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the user's deprecation noise is not the report
            return fn(*args, **kwargs), None
    except _PastDeadline as exc:
        raise AttnScopeError(f"the target {exc}") from None
    except (Exception, SystemExit) as exc:  # sys.exit() in the target is its failure, not ours
        return None, _exc_line(exc)
