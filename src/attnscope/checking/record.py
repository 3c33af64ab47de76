"""Record every tensor a target computes, the tensors it was computed from, and the line of
the target's code that made it.

A :class:`torch.overrides.TorchFunctionMode` sees each torch function and tensor method
the target calls, so nothing in the user's code has to change. The record is a dataflow
graph: every tensor is a node (:class:`Op`), made by an op from the nodes in its ``args``,
or a leaf (the probe input, a parameter, a buffer, a constant made outside the record).
Calls of the target's submodules are recorded as spans of that graph, so that an attention
layer can be found inside a wrapper. Fused ``scaled_dot_product_attention`` calls keep
their arguments, so that the stages they hide can be rebuilt.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

try:  # where torch.func.vmap's wrapper looks up the batching it runs (torch >= 2.0)
    import torch._functorch.apis as _vmap_apis
except ImportError:  # pragma: no cover - an older torch: vmap is left as it is
    _vmap_apis = None
#: torch's own batching, which the loop falls back on for arguments it does not handle
_VMAP_IMPL = getattr(_vmap_apis, "vmap_impl", None)

__all__ = ["Op", "ModuleCall", "SdpaCall", "Recorder", "short_path", "tensors_in"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(__file__))
# calls that return sizes, not tensors: nothing to record, and they are frequent
_SKIP_NAMES = {"size", "dim", "numel", "__len__", "is_floating_point", "__set__", "stride"}
#: calls whose tensors past the first n give only a dtype, device or shape: the output is
#: made from the first n alone (rotary tables cast ``.type_as(q)`` are not made from q)
_VALUE_ARGS = {
    "type_as": 1,
    "to": 1,
    "expand_as": 1,
    "view_as": 1,
    "reshape_as": 1,
    "zeros_like": 0,
    "ones_like": 0,
    "empty_like": 0,
    "full_like": 0,
    "rand_like": 0,
    "randn_like": 0,
    "new_zeros": 0,
    "new_ones": 0,
    "new_empty": 0,
    "new_full": 0,
}


@dataclass
class Op:
    """One node of the record: a tensor, the call that made it and where the target made it.

    ``args`` are the indices of the nodes the call took as tensors (the dataflow); a leaf
    (the probe input, a parameter, a buffer, a constant) has none, and ``leaf`` says which.
    ``func``, ``call_args`` and ``call_kwargs`` keep the call itself, so that a projection
    can be re-run on other inputs.
    """

    name: str
    output: torch.Tensor
    location: str | None
    index: int
    version: int = -1  # the tensor's _version when seen; -1 for tensors rebuilt by attnscope
    args: tuple[int, ...] = ()
    leaf: str | None = None
    func: object = field(default=None, repr=False)
    call_args: tuple = field(default=(), repr=False)
    call_kwargs: dict = field(default_factory=dict, repr=False)
    position: int = 0  # which output of a call that returns several (split, chunk)

    @property
    def stale(self) -> bool:
        """Changed in place since it was seen (its value then is gone; the new one is
        recorded again where it is used next)."""
        return self.version >= 0 and self.output._version != self.version

    @property
    def comparable(self) -> bool:
        """A floating-point tensor with axes: what a stage can be."""
        return self.output.is_floating_point() and self.output.dim() > 0


@dataclass
class ModuleCall:
    """A call of one of the target's submodules: the ops in ``[start, end)`` ran inside it."""

    path: str
    module: nn.Module
    start: int
    end: int = -1
    depth: int = 0


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
    enable_gqa: bool = False


def short_path(path: str) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


_CHECKER_DIR = os.path.dirname(__file__)


def _user_location() -> str | None:
    """``file:line`` of the innermost frame outside torch and attnscope. Reaching the
    checker's own frames first, the frames outside are the checker's caller, not the
    target's code: the line is then attnscope's own where its layer made the tensor, None
    where the checker itself did (a probe's layout undone on the way out)."""
    frame = sys._getframe(2)
    own = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_CHECKER_DIR):
            return own
        if own is None and path.startswith(_OWN_DIR):
            own = f"{short_path(path)}:{frame.f_lineno}"
        if not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR) or path.startswith("<")):
            return f"{short_path(path)}:{frame.f_lineno}"
        if path.startswith("<") and not path.startswith("<frozen"):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor in a call's arguments: bare, or inside lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def _op_name(func) -> str:
    name = getattr(func, "__name__", str(func))
    if name == "__get__":  # a property such as x.T or x.mT: name it by the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _vmap_as_loop(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs):
    """``torch.func.vmap(func)(*args)`` computed as the loop it stands for: ``func`` on each
    slice of the batched arguments, the results stacked on ``out_dims``.

    Under vmap a function sees batched tensors the record cannot keep (they are gone when
    the vmap returns), so a layer that vmaps one head's attention over its heads would
    show no attention at all. The loop computes the same values from ordinary tensors,
    and the record sees each head's scores, weights and context being made.
    """
    flat, spec = pytree.tree_flatten(args)
    dims = pytree._broadcast_to_and_flatten(in_dims, spec)
    if dims is None:  # in_dims that do not fit the arguments: vmap's own error says why
        return _VMAP_IMPL(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs)
    dims = [None if d is None else d % x.dim() for x, d in zip(flat, dims, strict=True)]
    sizes = {x.shape[d] for x, d in zip(flat, dims, strict=True) if d is not None}
    if len(sizes) != 1:
        return _VMAP_IMPL(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs)
    results = []
    for i in range(sizes.pop()):
        sliced = [x if d is None else x.select(d, i) for x, d in zip(flat, dims, strict=True)]
        results.append(pytree.tree_flatten(func(*pytree.tree_unflatten(sliced, spec), **kwargs)))
    out_spec = results[0][1]
    out_dims_flat = pytree._broadcast_to_and_flatten(out_dims, out_spec)
    stacked = []
    for j, d in enumerate(out_dims_flat):
        pieces = [flat_out[j] for flat_out, _ in results]
        stacked.append(pieces[0] if d is None else torch.stack(pieces, dim=d))
    return pytree.tree_unflatten(stacked, out_spec)


class Recorder(TorchFunctionMode):
    """Context manager that records the dataflow of a call.

    Args:
        leaves: tensors to label when they are first used, by identity: the probe input
            (``"input"``), parameters (``"param:NAME"``), buffers (``"buffer:NAME"``).
        root: the module whose submodule calls are recorded as :class:`ModuleCall` spans.
        limit: the most nodes kept (a runaway loop stops being recorded, not the target).
        scope: record only while this module (``root``, one layer of a model the record
            runs whole) computes: the record is then that layer's own.
    """

    def __init__(
        self,
        leaves: dict[int, str] | None = None,
        root: nn.Module | None = None,
        limit: int = 50000,
        scope: nn.Module | None = None,
    ):
        super().__init__()
        self.scope = scope
        self._in_scope = 0
        self.ops: list[Op] = []
        self.sdpa: list[SdpaCall] = []
        self.modules: list[ModuleCall] = []
        self.limit = limit
        self.leaves = leaves or {}
        self._paths = {id(m): p for p, m in root.named_modules()} if root is not None else {}
        self._node: dict[tuple[int, int], int] = {}
        self._latest: dict[int, int] = {}  # a tensor's latest node, by id
        self._writes: dict[int, list[int]] = {}  # nodes written in place, by storage
        self._alive: list[torch.Tensor] = []  # keeps ids unique while the record lives
        self._open: list[ModuleCall] = []
        self._hooks: list = []

    # ------------------------------------------------------------------ module spans
    def __enter__(self):
        if self._paths or self.scope is not None:
            reg = nn.modules.module
            self._hooks = [
                reg.register_module_forward_pre_hook(self._enter_module),
                reg.register_module_forward_hook(self._leave_module),
            ]
        self._vmap_saved = None
        if _VMAP_IMPL is not None and _vmap_apis.vmap_impl is not _vmap_as_loop:
            # (a record inside another's leaves the loop in place for the outer one)
            self._vmap_saved = _vmap_apis.vmap_impl
            _vmap_apis.vmap_impl = _vmap_as_loop
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._vmap_saved is not None:
            _vmap_apis.vmap_impl = self._vmap_saved
            self._vmap_saved = None
        for call in self._open:  # a call that raised never left
            call.end = len(self.ops)
        self._open = []
        return super().__exit__(*exc)

    def _enter_module(self, module, args):
        if module is self.scope:
            self._in_scope += 1
        path = self._paths.get(id(module))
        if path is not None:
            call = ModuleCall(path, module, len(self.ops), depth=len(self._open))
            self.modules.append(call)
            self._open.append(call)

    def _leave_module(self, module, args, out):
        if module is self.scope:
            self._in_scope -= 1
        if id(module) not in self._paths:
            return
        while self._open:
            call = self._open.pop()
            call.end = len(self.ops)
            if call.module is module:
                break

    # ------------------------------------------------------------------ dataflow
    def node_of(self, tensor: torch.Tensor) -> int | None:
        """The node of ``tensor`` as it is now, if it was recorded."""
        return self._node.get((id(tensor), tensor._version))

    def saw(self, tensor: torch.Tensor) -> bool:
        """Whether the run made or read ``tensor`` through a recorded call."""
        return id(tensor) in self._latest

    def _add(self, tensor, name, location, args=(), leaf=None, call=None, position=0) -> int:
        func, cargs, ckwargs = call if call is not None else (None, (), {})
        op = Op(
            name,
            tensor.detach(),  # no copy: a later in-place op marks this entry stale instead
            location,
            len(self.ops),
            tensor._version,
            tuple(args),
            leaf,
            func,
            cargs,
            ckwargs,
            position,
        )
        self.ops.append(op)
        self._alive.append(tensor)
        self._node[(id(tensor), tensor._version)] = op.index
        self._latest[id(tensor)] = op.index
        return op.index

    def _arg_nodes(self, tensors: list[torch.Tensor], name: str, location) -> list[int]:
        nodes = []
        for t in tensors:
            node = self.node_of(t)
            if node is None:
                node = self._written_through_view(t, location)
            if node is None:
                node = self._add(t, f"input of {name}", location, leaf=self.leaves.get(id(t)))
            nodes.append(node)
        return nodes

    @staticmethod
    def _storage(t: torch.Tensor) -> int | None:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (meta, some subclasses)
            return None
        return ptr or None

    def _written_through_view(self, t: torch.Tensor, location) -> int | None:
        """A recorded tensor changed since by an in-place write to another view of its
        storage (``rotate(torch.select(kv, 1, 0))`` writing into ``kv``): made from what it
        was and from what was written into it since."""
        prev = self._latest.get(id(t))
        ptr = self._storage(t)
        if prev is None or ptr is None:
            return None
        writes = [i for i in self._writes.get(ptr, []) if i > prev]
        if not writes:
            return None
        last: dict[int, int] = {}  # the latest write through each view
        for i in writes:
            last[id(self._alive[i])] = i
        return self._add(t, "written through a view", location, [prev, *sorted(last.values())])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in _SKIP_NAMES or len(self.ops) >= self.limit:
            return func(*args, **kwargs)
        if self.scope is not None and not self._in_scope:
            return func(*args, **kwargs)  # the model around the layer: not this record's
        location = _user_location()
        inputs = list(tensors_in(args)) + list(tensors_in(kwargs))
        before = [t._version for t in inputs]
        arg_nodes = self._arg_nodes(inputs, name, location)
        out = func(*args, **kwargs)
        call = (func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            self._record_sdpa(args, kwargs, out, location)
        # tensors changed in place (masked_fill_, out[:, i] = ..., add_) become new nodes
        for t, v in zip(inputs, before, strict=True):
            if t._version != v and self.node_of(t) is None:
                node = self._add(t, name, location, arg_nodes, call=call)
                ptr = self._storage(t)
                if ptr is not None:
                    self._writes.setdefault(ptr, []).append(node)
        made_from = arg_nodes[: _VALUE_ARGS[name]] if name in _VALUE_ARGS else arg_nodes
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for pos, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and self.node_of(t) is None:
                self._add(t, name, location, made_from, call=call, position=pos)
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
                bool(bound.get("enable_gqa", False)),
            )
        )
