"""Record every tensor a target computes, with the line of its code that made it.

A :class:`torch.overrides.TorchFunctionMode` sees each torch function and tensor method
the target calls, so nothing in the user's code has to change. Fused
``scaled_dot_product_attention`` calls are recorded with their arguments, so that the
stages they hide can be rebuilt.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["Op", "SdpaCall", "Recorder", "short_path"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(__file__))
_SKIP_NAMES = {"__get__", "__set__", "size", "dim", "numel", "__len__", "is_floating_point"}


@dataclass
class Op:
    """One recorded call: its name, output tensor and where the target called it."""

    name: str
    output: torch.Tensor
    location: str | None
    index: int
    version: int = -1  # the tensor's _version when seen; -1 for tensors rebuilt by attnscope

    @property
    def stale(self) -> bool:
        """Changed in place since it was seen (its value then is gone; the new one is
        recorded again where it is used next)."""
        return self.version >= 0 and self.output._version != self.version


@dataclass
class SdpaCall:
    """A fused ``scaled_dot_product_attention`` call, with what is needed to rebuild it."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    output: torch.Tensor
    location: str | None


def short_path(path: str) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def _user_location() -> str | None:
    """``file:line`` of the innermost frame outside torch and attnscope."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR) or path.startswith("<")):
            return f"{short_path(path)}:{frame.f_lineno}"
        if path.startswith("<") and not path.startswith("<frozen"):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class Recorder(TorchFunctionMode):
    """Context manager that records floating-point op outputs and fused attention calls."""

    def __init__(self, limit: int = 20000):
        super().__init__()
        self.ops: list[Op] = []
        self.sdpa: list[SdpaCall] = []
        self.limit = limit
        self._seen: set[tuple[int, int]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in _SKIP_NAMES or len(self.ops) >= self.limit:
            return out
        location = _user_location()
        if func is F.scaled_dot_product_attention:
            self._record_sdpa(args, kwargs, out, location)
        # inputs too: a matrix filled in place element by element is seen only when used
        for tensor in args:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dim():
                key = (id(tensor), tensor._version)
                if key not in self._seen:
                    self._seen.add(key)
                    self.ops.append(
                        Op(
                            f"input of {name}",
                            tensor.detach(),
                            location,
                            len(self.ops),
                            tensor._version,
                        )
                    )
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dim():
                # no copy: a later in-place op (masked_fill_) marks this entry stale instead
                self.ops.append(Op(name, tensor.detach(), location, len(self.ops), tensor._version))
                self._seen.add((id(tensor), tensor._version))
        return out

    def _record_sdpa(self, args, kwargs, out, location):
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        self.sdpa.append(
            SdpaCall(
                bound["query"].detach(),
                bound["key"].detach(),
                bound["value"].detach(),
                None if bound.get("attn_mask") is None else bound["attn_mask"].detach(),
                bool(bound.get("is_causal", False)),
                bound.get("scale"),
                out.detach(),
                location,
            )
        )
