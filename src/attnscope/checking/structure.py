"""Read an attention layer's structure from what it computes, not from what it names things.

From the dataflow of one recorded call (:class:`.record.Recorder`):

- **projections** are calls that apply a parameter linearly to a tensor made from the input
  (``F.linear``, ``Linear``, ``x @ W``, ``addmm`` as GPT-2's ``Conv1D`` does, ``einsum``
  with a kernel, ...), whatever holds the parameter; each is read back as ``x @ W + b``;
- the **core** is the product of two tensors made from the input (the token x token scores),
  then the product of what the scores became with a third (the context), or one fused
  attention call;
- the **queries** are what the projections make flow into the query side of the scores, the
  **keys** into the other side, the **values** into the side of the context product that
  the weights multiply;
- the **heads** come from the shapes the computation makes: the size the scores contract
  over is the head size, and the queries' width over it the head count;
- the **output projection** is the projection applied to what the context became;
- the **layer** is the innermost submodule whose call holds all of it: the target may be a
  wrapper, a block or a decoder layer;
- a **causal mask** is a triangular mask applied on the way from the scores to the context;
- what the checker does not model yet (rotary positions, QK norm, grouped key/value heads,
  position biases, sliding windows, cross-attention) is found and named with its line.

Names play no part in any of it; they only label the report (:attr:`Projection.source`).
"""

from __future__ import annotations

import linecache
import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import AttnScopeError
from .compare import close
from .record import ModuleCall, Op, Recorder, tensors_in

__all__ = [
    "Projection",
    "Core",
    "Structure",
    "read_structure",
    "projection_input",
    "keys_named_first",
    "stage_of",
    "Unsupported",
]

T = torch.Tensor

#: calls that can apply a weight to a tensor, or multiply two tensors made from the input
_LINEAR = {
    "linear",
    "matmul",
    "__matmul__",
    "__rmatmul__",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "einsum",
    "tensordot",
    "conv1d",
}
_PRODUCT = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "einsum", "tensordot"}
#: calls that only move, cut or copy entries: a query stays a query through them
_STRUCTURAL = {
    "view",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "split",
    "chunk",
    "unbind",
    "__getitem__",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "expand",
    "expand_as",
    "movedim",
    "swapaxes",
    "swapdims",
    "clone",
    "to",
    "float",
    "double",
    "half",
    "type",
    "type_as",
    "narrow",
    "select",
    "T",
    "mT",
    "mH",
    "H",
    "cat",
    "stack",
    "split_with_sizes",
    "tensor_split",
    "detach",
    "dropout",
    "view_as",
    "reshape_as",
    "__get__",
    "data",
}
_SCALAR_OPS = {"mul", "__mul__", "__rmul__", "div", "__truediv__", "__rtruediv__", "mul_", "div_"}
_ROTARY_CALLS = {"view_as_complex", "view_as_real", "polar", "complex"}
_NORM_CALLS = {"layer_norm", "rms_norm", "group_norm", "rsqrt"}
_MASKING = {"masked_fill", "masked_fill_", "where", "add", "__add__", "__radd__", "add_", "sub"}
_MASKING |= {"__sub__", "mul", "__mul__", "__rmul__", "mul_", "tril", "triu", "tril_", "triu_"}


class Unsupported(AttnScopeError):
    """The layer holds something the checker does not model yet: no verdict is given."""


@dataclass
class Projection:
    """One projection as the computation applied it: ``x @ w + b``, ``w`` ``(d_in, d_out)``.

    ``params`` are the dotted names of the parameters it read (labels only).
    """

    op: Op
    w: T
    b: T | None
    params: tuple[str, ...]
    input_node: int
    weight_names: tuple[str, ...] = ()  # the parameters read as the weight, where known
    bias_names: tuple[str, ...] = ()  # ... and as the bias
    #: the bias that belongs with the weight (the same Linear's, or the parameter paired
    #: with it), when the call applied another one or none
    companion: tuple[str, T] | None = None

    @property
    def width(self) -> int:
        return self.w.shape[1]

    @property
    def source(self) -> str:
        what = "+".join(self.params) if self.params else "a projection"
        return f"{what} ({self.op.name} at {self.op.location})" if self.op.location else what


@dataclass
class Core:
    """One attention computation: a scores product and its context product, or one fused
    call. ``*_node`` are the operands as the computation used them."""

    q_node: int
    k_node: int
    v_node: int | None
    head_dim: int
    score: Op | None = None
    context: Op | None = None
    fused: Op | None = None


@dataclass
class Structure:
    """What one recorded call says about the layer. See the module docstring."""

    layer: str  # dotted module path of the attention layer; "" for the target itself
    call: ModuleCall | None  # its call in the record (None for the target itself)
    input_node: int | None  # the tensor its projections read
    roles: dict[str, list[Projection]]  # "q", "k", "v" -> projections, in head order
    shared: dict[str, str]  # role -> the role whose projection it shares (combined weights)
    out: Projection | None
    unused: list[tuple[str, nn.Module | T]]  # the layer's projection weights never used
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    cores: list[Core]
    causal: str | None = None  # the evidence, with its line
    notes: list[str] = field(default_factory=list)
    #: ops inside the layer between its input and what the projections read (a norm the
    #: layer applies first): the stages are then checked from what the projections read
    pre: list[Op] = field(default_factory=list)

    @property
    def weightless(self) -> bool:
        return not any(self.roles.values())

    def describe(self) -> str:
        """``3 heads of 4 (queries: c_attn.weight (addmm at f.py:12), ...)``."""
        bits = []
        for role, label in (("q", "queries"), ("k", "keys"), ("v", "values")):
            projs = self.roles.get(role) or []
            if not projs:
                continue
            if role in self.shared:
                continue
            names = sorted({n for p in projs for n in p.params}) or ["?"]
            shared = [lab for r, lab in (("k", "keys"), ("v", "values")) if self.shared.get(r)]
            what = "/".join([label, *shared]) if role == "q" and shared else label
            if role == "k" and self.shared.get("v") == "k":
                what = "keys/values"
            bits.append(f"{what}: {', '.join(names)}")
        if self.out is not None:
            bits.append(f"out: {', '.join(self.out.params) or 'a projection'}")
        return "; ".join(bits)


# ------------------------------------------------------------------------------ graph


class _Graph:
    """Derived facts about the nodes of one record, computed once in index order."""

    def __init__(self, rec: Recorder):
        self.rec, self.ops = rec, rec.ops
        n = len(self.ops)
        self.tainted = [False] * n  # made from the probe input
        self.param = [False] * n  # made from a parameter (and not from the input)
        for op in self.ops:
            if op.leaf is not None:
                self.tainted[op.index] = op.leaf.startswith("input")
                self.param[op.index] = op.leaf.startswith("param:")
            else:
                self.tainted[op.index] = any(self.tainted[a] for a in op.args)
                self.param[op.index] = not self.tainted[op.index] and any(
                    self.param[a] for a in op.args
                )

    def tainted_args(self, op: Op) -> list[int]:
        out = []
        for a in op.args:
            if self.tainted[a] and a not in out:
                out.append(a)
        return out

    def roots(self, node: int) -> set[str]:
        """The input leaves a node was made from (``input:0``, ``input:1``...)."""
        seen, stack, found = set(), [node], set()
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            op = self.ops[i]
            if op.leaf is not None and op.leaf.startswith("input"):
                found.add(op.leaf)
            stack.extend(a for a in op.args if self.tainted[a])
        return found

    def params_of(self, op: Op, nodes: list[int] | None = None) -> tuple[str, ...]:
        """The parameters an op read (or these of its argument nodes), by name, through
        slices, transposes and views."""
        start = op.args if nodes is None else nodes
        seen, stack, names = set(), [a for a in start if self.param[a]], []
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            leaf = self.ops[i].leaf
            if leaf is not None and leaf.startswith("param:"):
                names.append(leaf[len("param:") :])
            stack.extend(a for a in self.ops[i].args if self.param[a])
        return tuple(sorted(set(names)))

    def original(self, node: int) -> T:
        """The tensor as the target had it (not the recorded detached alias)."""
        return self.rec._alive[node]


# ------------------------------------------------------------------------------ projections


def _replace(obj, old: T, new: T):
    if obj is old:
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(o, old, new) for o in obj)
    if isinstance(obj, dict):
        return {k: _replace(v, old, new) for k, v in obj.items()}
    return obj


def _exact(op: Op, x: T) -> tuple[T, T | None] | None:
    """``(W, b)`` read straight from the arguments of the common linear calls."""
    args = op.call_args
    f64 = torch.float64
    if op.name == "linear" and len(args) >= 2 and args[0] is x:
        w = args[1]
        b = args[2] if len(args) > 2 else op.call_kwargs.get("bias")
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            return w.detach().to(f64).T, None if b is None else b.detach().to(f64)
    if op.name == "addmm" and len(args) >= 3 and args[1] is x and not op.call_kwargs:
        b, w = args[0], args[2]
        if w.dim() == 2 and b.dim() <= 1:
            return w.detach().to(f64), b.detach().to(f64).expand(w.shape[1]).clone()
    if op.name in ("matmul", "__matmul__", "mm") and len(args) == 2 and args[0] is x:
        w = args[1]
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            return w.detach().to(f64), None
    return None


def _contracted(op: Op, x: T) -> list[int] | None:
    """The axes of ``x`` a linear call sums over (its features), by what the call does."""
    args = op.call_args
    name = op.name
    if name == "linear":
        return [x.dim() - 1]
    if name in ("matmul", "__matmul__", "mm", "bmm") and len(args) >= 2:
        return [x.dim() - 1] if args[0] is x else [max(x.dim() - 2, 0)]
    if name == "__rmatmul__" and len(args) >= 2:  # other @ self
        return [max(x.dim() - 2, 0)] if args[0] is x else [x.dim() - 1]
    if name in ("addmm", "baddbmm") and len(args) >= 3:
        return [x.dim() - 1] if args[1] is x else [max(x.dim() - 2, 0)]
    if name == "einsum":
        eq = args[0] if args and isinstance(args[0], str) else None
        operands = list(tensors_in(args[1:]))
        if eq is None or "->" not in eq or "..." in eq:
            return None
        lhs, out = eq.replace(" ", "").split("->")
        parts = lhs.split(",")
        for spec, t in zip(parts, operands, strict=False):
            if t is x:
                return [i for i, c in enumerate(spec) if c not in out]
        return None
    return [x.dim() - 1]


def _row_axes(x: T, out: T, features: list[int]) -> list[int] | None:
    """Where the rows of ``x`` (its axes other than ``features``) sit in ``out``: matched
    by size, in order (``(B, T, d) -> (B, H, T, hd)`` keeps B at 0 and T at 2)."""
    where: list[int] = []
    j = 0
    for i in range(x.dim()):
        if i in features:
            continue
        while j < out.dim() and out.shape[j] != x.shape[i]:
            j += 1
        if j == out.dim():
            return None
        where.append(j)
        j += 1
    return where


def _rows_first(t: T, rows: list[int]) -> T:
    """``t`` as ``(rows, features)``: its row axes first, the rest flattened in order."""
    rest = [i for i in range(t.dim()) if i not in rows]
    n = math.prod(t.shape[i] for i in rows)
    return t.permute(*rows, *rest).reshape(n, -1)


def _by_basis(op: Op, x: T, made: T) -> tuple[T, T | None] | None:
    """``(W, b)`` of any call that is affine in ``x`` row by row: re-run it on unit rows.

    The features are the axes the call sums over; the rows, the other axes of ``x``, which
    the output keeps (in whatever place).
    """
    features = _contracted(op, x)
    if features is None or op.func is None:
        return None
    x_rows = [i for i in range(x.dim()) if i not in features]
    where = _row_axes(x, made, features)
    if where is None:
        return None
    rows = math.prod(x.shape[i] for i in x_rows)
    d_in = math.prod(x.shape[i] for i in features)
    perm = x_rows + features
    inverse = [perm.index(i) for i in range(x.dim())]
    laid = [x.shape[i] for i in perm]
    basis = torch.cat([torch.zeros(1, d_in), torch.eye(d_in)]).to(x.dtype)
    ys = []
    with torch.no_grad():
        for start in range(0, d_in + 1, max(rows, 1)):
            chunk = basis[start : start + rows]
            pad = torch.zeros(rows - chunk.shape[0], d_in, dtype=x.dtype)
            probe = torch.cat([chunk, pad]).reshape(laid).permute(inverse)
            try:
                y = op.func(*_replace(op.call_args, x, probe), **_replace(op.call_kwargs, x, probe))
            except Exception:  # a call that cannot take other rows is not a projection
                return None
            if not isinstance(y, torch.Tensor) or y.shape != made.shape:
                return None
            ys.append(_rows_first(y, where)[: chunk.shape[0]].double())
    y = torch.cat(ys)
    b, w = y[0], y[1:] - y[0]
    got = _rows_first(x.detach().double(), x_rows) @ w + b
    if not close(_rows_first(made, where), got, rtol=1e-3):
        return None  # not one affine map applied row by row
    return w, (None if bool((b == 0).all()) else b)


def _projection(g: _Graph, op: Op) -> Projection | None:
    if op.name not in _LINEAR or op.func is None:
        return None
    tainted = g.tainted_args(op)
    if len(tainted) != 1 or not g.tainted[op.index] or op.position != 0:
        return None
    if not any(g.param[a] for a in op.args):
        return None
    x = g.original(tainted[0])
    made = op.output
    if op.stale:  # changed in place since (q *= scale): what the call made, made again
        with torch.no_grad():
            made = op.func(*op.call_args, **op.call_kwargs)
        if not isinstance(made, torch.Tensor):
            return None
    found = _exact(op, x)
    if found is not None:  # confirm: the map read from the arguments makes the output
        w, b = found
        got = x.detach().double().reshape(-1, w.shape[0]) @ w + (0 if b is None else b)
        if got.numel() != made.numel() or not close(made.reshape(got.shape), got, rtol=1e-3):
            found = None
    found = found or _by_basis(op, x, made)
    if found is None:
        return None
    w, b = found
    # which arguments were the weight and the bias (for the common calls)
    w_at, b_at = {"linear": (1, 2), "addmm": (2, 0), "matmul": (1, None)}.get(op.name, (None, None))
    w_at, b_at = (1, None) if op.name in ("__matmul__", "mm") else (w_at, b_at)
    wn = g.params_of(op, [op.args[w_at]]) if w_at is not None and w_at < len(op.args) else ()
    bn = g.params_of(op, [op.args[b_at]]) if b_at is not None and b_at < len(op.args) else ()
    return Projection(op, w, b, g.params_of(op), tainted[0], wn, bn)


def _fold_bias(g: _Graph, op: Op, projs: dict[int, Projection]) -> Projection | None:
    """``x @ W + b`` written as two calls: the addition of a parameter vector to a
    projection's output is part of the projection."""
    if op.name not in ("add", "__add__", "__radd__", "add_") or len(op.args) != 2:
        return None
    made = [a for a in op.args if a in projs]
    other = [a for a in op.args if a not in projs]
    if len(made) != 1 or len(other) != 1 or not g.param[other[0]]:
        return None
    p, bias = projs[made[0]], g.ops[other[0]].output
    if bias.numel() != p.width or (bias.dim() and bias.shape[-1] != p.width):
        return None
    if op.output.shape != g.ops[made[0]].output.shape:
        return None
    b = bias.detach().double().reshape(-1) + (0 if p.b is None else p.b)
    names = g.params_of(op, [other[0]])
    return Projection(op, p.w, b, (*p.params, *names), p.input_node, p.weight_names, names)


# ------------------------------------------------------------------------------ the core


def _expand_ellipsis(spec: str, ndim: int, width: int) -> str:
    """``...qd`` with 4 axes -> ``ABqd`` (the broadcast axes as capitals, right-aligned)."""
    if "..." not in spec:
        return spec
    named = len(spec) - 3
    letters = "ABCDEFGHIJKLMNOP"[width - max(ndim - named, 0) : width]
    return spec.replace("...", letters)


def _einsum_sides(op: Op) -> tuple[int, int, int] | None:
    """For a two-operand einsum: (query operand, key operand, contracted size)."""
    eq = op.call_args[0] if op.call_args and isinstance(op.call_args[0], str) else None
    operands = list(tensors_in(op.call_args[1:]))
    if eq is None or len(operands) != 2 or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    parts = lhs.split(",")
    if len(parts) != 2:
        return None
    width = (
        max(t.dim() - (len(p) - 3) for t, p in zip(operands, parts, strict=True) if "..." in p)
        if "..." in eq
        else 0
    )
    a, b = (_expand_ellipsis(p, t.dim(), width) for p, t in zip(parts, operands, strict=True))
    out = _expand_ellipsis(out, width + 3, width) if "..." in out else out
    free_a = [c for c in out if c in a and c not in b]
    free_b = [c for c in out if c in b and c not in a]
    if not free_a or not free_b:
        return None
    contracted = [c for c in a if c in b and c not in out]
    size = 1
    for c in contracted:
        size *= operands[0].shape[a.index(c)]
    first = min(out.index(free_a[-1]), out.index(free_b[-1]))
    q_side = 0 if out[first] in free_a else 1
    return q_side, 1 - q_side, size


def _pairwise_sides(g: _Graph, op: Op) -> tuple[int, int, int] | None:
    """Two tensors made from the input combined pair by pair (broadcast across each other:
    cosine similarity, distances, ``q[:, :, None] * k[:, None]``): the query side is the
    one whose tokens run along the earlier of the two crossed axes."""
    tensors = list(tensors_in(op.call_args)) + list(tensors_in(op.call_kwargs))
    if len(tensors) != len(op.args):
        return None
    pairs = [(t, n) for t, n in zip(tensors, op.args, strict=True) if g.tainted[n]]
    if len(pairs) != 2 or pairs[0][1] == pairs[1][1]:
        return None
    (ta, na), (tb, nb) = pairs
    if op.name == "cdist" and ta.dim() == tb.dim() >= 2:
        return na, nb, ta.shape[-1]
    nd = max(ta.dim(), tb.dim())
    sa = (1,) * (nd - ta.dim()) + tuple(ta.shape)
    sb = (1,) * (nd - tb.dim()) + tuple(tb.shape)
    a_only = [i for i in range(nd) if sa[i] > 1 and sb[i] == 1]
    b_only = [i for i in range(nd) if sb[i] > 1 and sa[i] == 1]
    if not a_only or not b_only:
        return None
    q_first = a_only[0] < b_only[0]
    return (na, nb, ta.shape[-1]) if q_first else (nb, na, tb.shape[-1])


def _product_sides(g: _Graph, op: Op) -> tuple[int, int, int] | None:
    """(query-side node, key-side node, contracted size) of a product of two tensors."""
    tensors = list(tensors_in(op.call_args)) + list(tensors_in(op.call_kwargs))
    nodes = op.args
    if len(tensors) != len(nodes):
        return None
    pairs = [(t, n) for t, n in zip(tensors, nodes, strict=True) if g.tainted[n]]
    if op.name == "einsum":
        sides = _einsum_sides(op)
        if sides is None or len(pairs) != 2:
            return None
        return pairs[sides[0]][1], pairs[sides[1]][1], sides[2]
    if len(pairs) == 1 and len(nodes) >= 2 and nodes.count(pairs[0][1]) >= 2:
        pairs = [pairs[0], pairs[0]]  # x @ x.T written on one tensor
    if len(pairs) != 2:
        return None
    (ta, na), (tb, nb) = pairs
    if op.name == "__rmatmul__":
        (ta, na), (tb, nb) = (tb, nb), (ta, na)
    return na, nb, ta.shape[-1] if ta.dim() else 1


def _named_nodes(op: Op, names: list[str]) -> dict[str, int]:
    """Nodes of a call's tensor arguments by parameter name, in the recorder's order
    (positional arguments first, then keywords)."""
    found: dict[str, int] = {}
    i = 0
    for pos, arg in enumerate(op.call_args):
        n = len(list(tensors_in(arg)))
        if n == 1 and pos < len(names) and isinstance(arg, torch.Tensor):
            found[names[pos]] = op.args[i]
        i += n
    for key, arg in op.call_kwargs.items():
        n = len(list(tensors_in(arg)))
        if n == 1 and isinstance(arg, torch.Tensor):
            found[key] = op.args[i]
        i += n
    return found


def _fused_sdpa(op: Op) -> Core | None:
    nodes = _named_nodes(op, ["query", "key", "value", "attn_mask"])
    if not {"query", "key", "value"} <= nodes.keys():
        return None
    q = op.call_args[0] if op.call_args else op.call_kwargs["query"]
    return Core(nodes["query"], nodes["key"], nodes["value"], q.shape[-1], fused=op)


# ------------------------------------------------------------------------------ reading


def read_structure(rec: Recorder, root: nn.Module) -> Structure:
    """The structure of the attention in one recorded call of ``root`` (see module doc).

    Raises:
        Unsupported: the computation holds a feature the checker does not model yet.
        AttnScopeError: no attention, or more than one attention layer, was found.
    """
    return _Reader(rec, root).read()


class _Reader:
    def __init__(self, rec: Recorder, root: nn.Module):
        self.rec, self.root = rec, root
        self.g = _Graph(rec)
        self.ops = rec.ops

    # -- projections and the core
    def read(self) -> Structure:
        g = self.g
        projs: dict[int, Projection] = {}
        after_score = [False] * len(self.ops)
        after_context = [False] * len(self.ops)
        cores: list[Core] = []
        mha = None
        for op in self.ops:
            i = op.index
            if op.args:
                after_score[i] = any(after_score[a] for a in op.args)
                after_context[i] = any(after_context[a] for a in op.args)
            if not g.tainted[i] or op.leaf is not None:
                continue
            if op.name == "multi_head_attention_forward" and op.position == 0:
                mha = op
                after_score[i] = after_context[i] = True
                continue
            if op.name == "scaled_dot_product_attention" and op.position == 0:
                core = _fused_sdpa(op)
                if core is not None:
                    cores.append(core)
                after_score[i] = after_context[i] = True
                continue
            proj = _projection(g, op)
            if proj is None:
                proj = _fold_bias(g, op, projs)
                if proj is not None:  # the bias joins the projection it follows
                    projs.pop(next(a for a in op.args if a in projs))
            if proj is not None:
                projs[i] = proj
                continue
            if op.position != 0:
                continue
            sides = _product_sides(g, op) if op.name in _PRODUCT else _pairwise_sides(g, op)
            if sides is None:
                continue
            a, b, size = sides
            if not after_score[a] and not after_score[b]:
                cores.append(Core(a, b, None, size, score=op))
                after_score[i] = True
            elif after_score[a] != after_score[b]:
                weights, values = (a, b) if after_score[a] else (b, a)
                core = self._core_for(cores, weights)
                if core is not None and core.context is None:
                    core.v_node, core.context = values, op
                    after_context[i] = True
        if mha is not None:
            return self._from_mha(mha, after_context)
        for p in projs.values():
            p.companion = self._companion(p)
        cores = [c for c in cores if c.fused is not None or c.context is not None]
        if not cores:
            raise AttnScopeError(
                "found no attention in its computation: expected a product of two tensors made "
                "from the input (the scores), then a product of what they became with a third "
                "(the context), or a call of scaled_dot_product_attention"
            )
        return self._assemble(cores, projs, after_context)

    def _companion(self, p: Projection) -> tuple[str, T] | None:
        """The bias that belongs with a projection's weight, where the call applied another
        (or none): the same Linear's ``bias``, or a bare parameter paired with the weight
        (``q_w``/``q_b``, ``W_q``/``b_q``, ``wq``/``bq``, ``q_weight``/``q_bias``)."""
        if len(p.weight_names) != 1:
            return None
        name = p.weight_names[0]
        owner, _, last = name.rpartition(".")
        prefix = f"{owner}." if owner else ""
        pairs = [(r"^weight$", "bias"), (r"_w$", "_b"), (r"_weight$", "_bias")]
        pairs += [(r"^[wW]_", "b_"), (r"^weight_", "bias_"), (r"^w(?=[a-z])", "b")]
        params = dict(self.root.named_parameters())
        for pattern, repl in pairs:
            if not re.search(pattern, last):
                continue
            cand = prefix + re.sub(pattern, repl, last, count=1)
            bias = params.get(cand)
            if bias is None or bias.dim() != 1 or bias.shape[0] != p.width:
                continue
            if p.bias_names == (cand,):
                return None  # it applied its own
            return cand, bias.detach().double()
        return None

    def _core_for(self, cores: list[Core], weights: int) -> Core | None:
        """The scores product a weights tensor was made from (the latest one)."""
        anc = self._ancestors(weights)
        for core in reversed(cores):
            if core.score is not None and core.score.index in anc:
                return core
        return None

    def _ancestors(self, node: int, stop: set[int] | None = None) -> set[int]:
        seen, stack = set(), [node]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if stop and i in stop:
                continue
            stack.extend(a for a in self.ops[i].args if self.g.tainted[a])
        return seen

    def _projections_above(self, node: int, projs: dict[int, Projection]) -> list[Projection]:
        """The projections nearest above a node (not past one), in index order."""
        found = self._ancestors(node, stop=set(projs))
        return [projs[i] for i in sorted(found) if i in projs]

    # -- roles, heads, layer
    def _assemble(self, cores, projs, after_context) -> Structure:
        roles: dict[str, list[Projection]] = {"q": [], "k": [], "v": []}
        for core in cores:
            for role, node in (("q", core.q_node), ("k", core.k_node), ("v", core.v_node)):
                for p in self._projections_above(node, projs):
                    if all(p.op.index != o.op.index for o in roles[role]):
                        roles[role].append(p)
        call = self._layer_call(cores, roles)
        span = (call.start, call.end) if call is not None else (0, len(self.ops))
        if self._sequential(cores):
            raise AttnScopeError(
                "holds several attention layers, one after the other (a whole model): checking "
                "a model is not supported yet; check one of its attention layers"
            )
        out = self._out_projection(projs, after_context, span)
        shared = self._shared(roles, cores)
        head_dim = cores[0].head_dim
        if head_dim <= 1 and cores[0].v_node is not None:  # scores not made by a product
            head_dim = self.ops[cores[0].v_node].output.shape[-1]
        heads = kv_heads = None
        widths = self._widths(roles, shared, cores)
        if cores[0].fused is not None and cores[0].fused.output.dim() >= 3:
            q_arg = self.ops[cores[0].q_node].output
            k_arg = self.ops[cores[0].k_node].output
            if q_arg.dim() == 4:
                heads, kv_heads = q_arg.shape[1], k_arg.shape[1]
        if heads is None and widths["q"] and head_dim and widths["q"] % head_dim == 0:
            heads = widths["q"] // head_dim
            kv_heads = widths["k"] // head_dim if widths["k"] % head_dim == 0 else None
        input_node = roles["q"][0].input_node if roles["q"] else cores[0].q_node
        s = Structure(
            layer=call.path if call is not None else "",
            call=call,
            input_node=input_node,
            roles=roles,
            shared=shared,
            out=out if out is not None and span[0] <= out.op.index < span[1] else None,
            unused=self._unused(call, span),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            cores=cores,
        )
        s.pre = self._pre(s)
        _Features(self, s, after_context).find()
        return s

    def _pre(self, s: Structure) -> list[Op]:
        """Transforms of the input inside the layer before the projections (not layout)."""
        if s.input_node is None or not s.roles["q"]:
            return []
        start = s.call.start if s.call is not None else 0
        inputs = {p.input_node for ps in s.roles.values() for p in ps}
        if len(inputs) != 1:
            return []
        found = [
            self.ops[i]
            for i in sorted(self._ancestors(s.input_node))
            if i >= start and self.ops[i].leaf is None
        ]
        return found if any(op.name not in _STRUCTURAL for op in found) else []

    def _widths(self, roles, shared, cores) -> dict[str, int]:
        """How many features each role has, all heads together. One combined weight is cut
        by what the queries read from it (a multi-query weight is not cut in thirds)."""
        total = {r: sum(p.width for p in roles[r]) for r in ("q", "k", "v")}
        if not shared:
            return total
        read = self._read_width(roles["q"], [c.q_node for c in cores])
        if shared.get("k") == "q" and shared.get("v") == "q":
            rest = total["q"] - read
            return {"q": read, "k": rest // 2, "v": rest // 2}
        if shared.get("v") == "k":
            return {"q": total["q"], "k": total["k"] // 2, "v": total["k"] // 2}
        return {"q": read, "k": total["q"] - read, "v": total["v"]}

    def _read_width(self, projs: list[Projection], nodes: list[int]) -> int:
        """Features per row in the given operands, rows counted as the projections make
        them (a (B, H, T, hd) operand of a (B, T, 3*d) projection reads H*hd)."""
        rows = projs[0].op.output.numel() // projs[0].width
        return sum(self.ops[n].output.numel() for n in set(nodes)) // max(rows, 1)

    def _shared(self, roles, cores) -> dict[str, str]:
        """Roles cut from the very same call as an earlier role (one combined weight).

        A call whose whole output is used as two roles (``k = q``) is not combined: each
        role then reads as wide a tensor as the call makes.
        """
        shared = {}
        for later, earlier in (("k", "q"), ("v", "q"), ("v", "k")):
            if later in shared:
                continue
            a = [p.op.index for p in roles[later]]
            b = [p.op.index for p in roles[earlier]]
            if a and a == b and not self._reused(roles[earlier], cores):
                shared[later] = shared.get(earlier, earlier)
        return shared

    def _reused(self, projs: list[Projection], cores: list[Core]) -> bool:
        """Whether the queries read the projections' whole width (one tensor used twice)."""
        width = self._read_width(projs, [c.q_node for c in cores])
        return width >= sum(p.width for p in projs)

    def _sequential(self, cores: list[Core]) -> bool:
        """Whether one core's scores were made from another core's context (layers in a row)."""
        contexts = {c.context.index if c.context else c.fused.index for c in cores}
        for core in cores:
            anc = self._ancestors(core.q_node) | self._ancestors(core.k_node)
            own = core.context.index if core.context else core.fused.index
            if (contexts - {own}) & anc:
                return True
        return False

    def _layer_call(self, cores, roles) -> ModuleCall | None:
        """The innermost submodule call that holds every projection and product found."""
        needed = [p.op.index for ps in roles.values() for p in ps]
        for c in cores:
            needed += [op.index for op in (c.score, c.context, c.fused) if op is not None]
        lo, hi = min(needed), max(needed)
        best = None
        for call in self.rec.modules:
            if not call.path:  # the target itself
                continue
            if call.start <= lo and hi < call.end and (best is None or call.depth > best.depth):
                best = call
        return best

    def _out_projection(self, projs, after_context, span) -> Projection | None:
        """The projection applied to what the context became; projections applied to each
        head's context apart (``F.linear(ctx[:, h], W_o[:, cols])``) read as one."""
        found = [
            projs[i]
            for i in sorted(projs)
            if span[0] <= i < span[1] and after_context[projs[i].input_node]
        ]
        if not found:
            return None
        first = found[0]
        later = self._descendants(first.op.index)
        parallel = [p for p in found if p.op.index not in later or p is first]
        if len(parallel) == 1 or any(p.w.shape[1] != first.w.shape[1] for p in parallel):
            return first
        w = torch.cat([p.w for p in parallel], dim=0)
        names = tuple(sorted({n for p in parallel for n in p.params}))
        return Projection(first.op, w, first.b, names, first.input_node)

    def _descendants(self, node: int) -> set[int]:
        out = {node}
        for op in self.ops[node + 1 :]:
            if any(a in out for a in op.args):
                out.add(op.index)
        return out

    def _unused(self, call: ModuleCall | None, span) -> list[tuple[str, nn.Module | T]]:
        """Projection weights the layer holds and its computation never read: an output
        projection defined and skipped, or W_key defined while keys were made with W_query."""
        module = call.module if call is not None else self.root
        prefix = f"{call.path}." if call is not None and call.path else ""
        read = set()
        for op in self.ops:
            if op.leaf is not None and op.leaf.startswith("param:"):
                read.add(op.leaf[len("param:") :])
        found: list[tuple[str, nn.Module | T]] = []
        owners = set()
        for name, sub in module.named_modules():
            w = getattr(sub, "weight", None)
            if name and isinstance(w, torch.Tensor) and w.dim() == 2:
                owners.add(name)
                if f"{prefix}{name}.weight" not in read:
                    found.append((name, sub))
        for name, p in module.named_parameters():
            owner = name.rpartition(".")[0]
            if owner in owners or p.dim() not in (2, 3) or f"{prefix}{name}" in read:
                continue
            found.append((name, p))
        return found

    # -- torch's own MultiheadAttention
    def _from_mha(self, op: Op, after_context) -> Structure:
        import inspect

        bound = inspect.signature(F.multi_head_attention_forward).bind(
            *op.call_args, **op.call_kwargs
        )
        a = bound.arguments
        f64 = torch.float64
        e, heads = a["embed_dim_to_check"], a["num_heads"]
        names = self.g.params_of(op)
        q_node = op.args[0]

        def proj(w, b) -> Projection:
            return Projection(
                op, w.detach().to(f64).T, None if b is None else b.detach().to(f64), names, q_node
            )

        bias = a.get("in_proj_bias")
        if a.get("use_separate_proj_weight"):
            ws = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
        else:
            ws = tuple(a["in_proj_weight"][i * e : (i + 1) * e] for i in range(3))
        roles = {
            r: [proj(w, None if bias is None else bias[i * e : (i + 1) * e])]
            for i, (r, w) in enumerate(zip(("q", "k", "v"), ws, strict=True))
        }
        out = proj(a["out_proj_weight"], a.get("out_proj_bias"))
        call = self._layer_call([Core(q_node, q_node, None, e // heads, fused=op)], roles)
        s = Structure(
            layer=call.path if call is not None else "",
            call=call,
            input_node=q_node,
            roles=roles,
            shared={},
            out=out,
            unused=[],
            heads=heads,
            kv_heads=heads,
            head_dim=e // heads,
            cores=[Core(q_node, op.args[1], op.args[2], e // heads, fused=op)],
        )
        if a.get("is_causal"):
            s.causal = f"is_causal=True at {op.location}"
        mask = a.get("attn_mask")
        if mask is not None:
            shape = _mask_shape(mask.bool() if mask.dtype == torch.bool else mask < -1e4)
            if shape is not None and shape[0] in ("causal", "anti-causal"):
                s.causal = f"a {shape[0]} attn_mask at {op.location}"
        roots = self.g.roots(op.args[0]), self.g.roots(op.args[1])
        if roots[0] != roots[1]:
            raise Unsupported(
                f"not supported yet: cross-attention (keys and values from another input than "
                f"the queries) at {op.location}"
            )
        return s


# ------------------------------------------------------------------------------ features


_SOFTMAX_LIKE = {"softmax", "_softmax", "log_softmax", "exp", "exp2", "sigmoid", "softmax_"}


def stage_of(rec: Recorder, st: Structure, index: int):
    """The stage a recorded op belongs to, by where it sits between the core's products:
    a projection's path, the scores, the steps to the weights, the context, the output."""
    from ..stages import Stage

    ops = rec.ops

    def descendants(node: int) -> set[int]:
        out = {node}
        for op in ops[node + 1 :]:
            if any(a in out for a in op.args):
                out.add(op.index)
        return out

    def ancestors(node: int) -> set[int]:
        seen, stack = set(), [node]
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(ops[i].args)
        return seen

    core = st.cores[0]
    made = core.score or core.fused
    mixed = core.context or core.fused
    if made is None or mixed is None:
        return None
    if index == mixed.index:
        return Stage.WEIGHTS if core.fused is not None else Stage.CONTEXT
    if index in descendants(mixed.index):
        return Stage.OUTPUT
    if index == made.index:
        return Stage.SCORES
    after = descendants(made.index)
    if index in after:
        steps = {ops[i].name for i in ancestors(index) & after}
        if steps & _SOFTMAX_LIKE or ops[index].name in _SOFTMAX_LIKE:
            return Stage.WEIGHTS
        return Stage.MASKED_SCORES if steps & _MASKING and st.causal else Stage.SCALED_SCORES
    for node, stage in ((core.q_node, Stage.QUERIES), (core.k_node, Stage.KEYS)):
        if index in ancestors(node):
            return stage
    if core.v_node is not None and index in ancestors(core.v_node):
        return Stage.VALUES
    return None


def _statement(path: str, line: int, most: int = 8) -> str:
    """The source statement starting at ``line``: its lines until the brackets close."""
    text, depth = "", 0
    for i in range(line, line + most):
        part = linecache.getline(path, i)
        if not part:
            break
        text += part
        depth += part.count("(") + part.count("[") - part.count(")") - part.count("]")
        if depth <= 0:
            break
    return text


def keys_named_first(st: Structure) -> bool:
    """Whether the line that makes the scores names a key operand before a query one
    (``torch.baddbmm(s, key, query.mT)``, ``k @ q.transpose(-2, -1)``).

    With one combined qkv weight, keys times queries and chunks unpacked in the wrong order
    give the same numbers; only the code's own words tell which mistake was made.
    """
    core = st.cores[0]
    op = core.score or core.fused
    if op is None or not op.location or ":" not in op.location:
        return False
    path, _, line = op.location.rpartition(":")
    text = _statement(path, int(line)) if line.isdigit() else ""
    text = re.sub(r"^\s*[\w.,\[\]\s]+?=(?!=)", "", text)  # an assignment's target
    words = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)
    roles = [role_hint(w) for w in words if role_hint(w) in ("q", "k")]
    return roles[:2] == ["k", "q"]


def projection_input(rec: Recorder, st: Structure, like: T) -> T | None:
    """In another call's record, what the query projection read, laid out as ``like``
    ``(batch, tokens, d)``: the reference input of a layer that transforms its input first."""
    q = st.roles["q"][0]
    g = _Graph(rec)
    for op in rec.ops:
        if op.name != q.op.name or op.leaf is not None or not g.tainted[op.index]:
            continue
        if g.params_of(op) != q.params:
            continue
        tainted = g.tainted_args(op)
        if len(tainted) != 1:
            continue
        t = g.original(tainted[0]).detach()
        b, n = like.shape[0], like.shape[-2]
        d = t.shape[-1]
        if t.shape[:-1] == like.shape[:-1]:
            return t
        if t.dim() == 3 and t.shape[:2] == (n, b):
            return t.transpose(0, 1)
        if t.numel() == b * n * d:
            return t.reshape(*like.shape[:-1], d)
    return None


def _mask_shape(hidden: T) -> tuple[str, int] | None:
    """What a hidden-cells pattern is, on its last two axes: ``("causal", d)`` when it hides
    keys ``j - i >= d``, ``("anti-causal", d)`` when it hides ``j - i <= d``, ``("window",
    w)`` for a causal band ``w`` keys wide (the query included), or None."""
    if hidden.dim() < 2:
        return None
    h = hidden.reshape(-1, *hidden.shape[-2:])[0]
    n, m = h.shape
    if n != m or n < 2:
        return None
    ones = torch.ones(n, n, dtype=torch.bool)
    for d in range(-n + 1, n + 1):
        if torch.equal(h, ones.triu(d)):
            return ("causal", d)
        if torch.equal(h, ones.tril(d)):
            return ("anti-causal", d)
    for w in range(1, n):
        if torch.equal(h, ones.triu(1) | ones.tril(-w)):
            return ("window", w)
    return None


class _Features:
    """Causal masks and the features not modelled yet, each found on its path."""

    def __init__(self, reader: _Reader, s: Structure, after_context):
        self.r, self.s, self.g, self.ops = reader, s, reader.g, reader.ops
        self.after_context = after_context

    def find(self) -> None:
        s = self.s
        self._cross()
        if s.heads and s.kv_heads and s.kv_heads != s.heads:
            self._refuse(
                f"grouped key/value heads ({s.heads} query heads, {s.kv_heads} key/value heads)",
                s.roles["k"][0].op.location if s.roles["k"] else None,
            )
        for core in s.cores:
            for role, node in (("queries", core.q_node), ("keys", core.k_node)):
                self._qk_path(role, node)
            self._score_path(core)

    def _refuse(self, what: str, where: str | None) -> None:
        at = f" at {where}" if where else ""
        raise Unsupported(f"not supported yet: {what}{at}")

    def _cross(self) -> None:
        s = self.s
        q = (
            set().union(*(self.g.roots(p.input_node) for p in s.roles["q"]))
            if s.roles["q"]
            else set()
        )
        for role in ("k", "v"):
            for p in s.roles[role]:
                if q and self.g.roots(p.input_node) != q:
                    self._refuse(
                        "cross-attention (keys and values projected from another input than "
                        "the queries)",
                        p.op.location,
                    )

    def _path(self, node: int, stops: set[int]) -> list[Op]:
        """The ops between the projections (or the layer's input) and a core operand."""
        start = self.s.call.start if self.s.call is not None else 0
        before = {op.index for op in self.ops[:start]}
        seen = self.r._ancestors(node, stop=stops | before)
        return [
            self.ops[i]
            for i in sorted(seen)
            if i not in stops and i >= start and self.ops[i].leaf is None
        ]

    def _qk_path(self, role: str, node: int) -> None:
        stops = {p.op.index for ps in self.s.roles.values() for p in ps}
        for op in self._path(node, stops):
            name = op.name
            if name in _ROTARY_CALLS:
                self._refuse("rotary position embedding (complex rotation)", op.location)
            if name in _NORM_CALLS:
                self._refuse(f"a norm applied to the {role} (QK norm)", op.location)
            if name in _STRUCTURAL or name not in (_SCALAR_OPS | {"add", "__add__", "sub"}):
                continue
            consts = [self.ops[a].output for a in op.args if not self.g.tainted[a]]
            varying = [t for t in consts if t.numel() > 1 and not bool((t == t.flatten()[0]).all())]
            if varying:
                rotates = any(
                    o.name in ("cat", "neg", "__neg__", "stack", "flip")
                    for o in self._path(node, stops)
                )
                what = (
                    "rotary position embedding (cos/sin tables)"
                    if rotates
                    else f"a position- or feature-dependent factor on the {role}"
                )
                self._refuse(what, op.location)

    def _score_path(self, core: Core) -> None:
        s = self.s
        if core.fused is not None:
            return self._fused_masks(core)
        start = core.score.index
        end = core.context.index
        reach = {start}
        for op in self.ops[start + 1 : end + 1]:
            if any(a in reach for a in op.args):
                reach.add(op.index)
        for i in sorted(reach):
            op = self.ops[i]
            if op.name not in _MASKING or i == start:
                continue
            evidence = self._mask_of(op, reach)
            if evidence is None:
                continue
            kind, detail = evidence
            if kind == "bias":
                self._refuse(detail, op.location)
            if kind == "window":
                self._refuse(f"a sliding-window mask ({detail})", op.location)
            if s.causal is None:
                s.causal = f"{detail} at {op.location}"

    def _mask_of(self, op: Op, reach: set[int]) -> tuple[str, str] | None:
        """What a masking op does to the score path: a mask (causal or not) or a bias."""
        name = op.name
        if name in ("tril", "triu", "tril_", "triu_"):
            n = op.output.shape[-1]
            d = op.call_args[1] if len(op.call_args) > 1 else op.call_kwargs.get("diagonal", 0)
            ones = torch.ones(n, n, dtype=torch.bool)
            hidden = ~ones.tril(d) if name.startswith("tril") else ~ones.triu(d)
            return self._judge_hidden(hidden, f"{name} on the scores")
        consts = [(pos, self.ops[a].output) for pos, a in enumerate(op.args) if a not in reach]
        consts = [(pos, t) for pos, t in consts if not self.g.tainted[op.args[pos]]]
        if not consts:
            return None
        if name in ("masked_fill", "masked_fill_"):
            mask = next((t for _, t in consts if t.dtype == torch.bool), None)
            return None if mask is None else self._judge_hidden(mask, "a masked_fill")
        if name == "where":
            cond = op.args[0] if op.args else None
            if cond is None or cond in reach:
                return None
            c = self.ops[cond].output.bool()
            scores_first = len(op.args) > 1 and op.args[1] in reach
            return self._judge_hidden(~c if scores_first else c, "torch.where")
        t = consts[0][1]
        if t.numel() <= 1 or t.dim() < 2:
            return None
        if name in ("mul", "__mul__", "__rmul__", "mul_"):
            return self._judge_hidden(t == 0, "a multiplicative mask")
        # additive: a mask (0 / very negative) or a bias (many finite values)
        t64 = t.double()
        finite = t64[torch.isfinite(t64) & (t64 > -1e4)]
        distinct = torch.unique(finite).numel()
        if distinct > 2:
            learned = self.g.param[op.args[consts[0][0]]]
            what = (
                "a learned relative position bias added to the scores"
                if learned
                else "a position bias added to the scores (ALiBi)"
            )
            return ("bias", what)
        return self._judge_hidden(~torch.isfinite(t64) | (t64 < -1e4), "an additive mask")

    def _judge_hidden(self, hidden: T, how: str) -> tuple[str, str] | None:
        shape = _mask_shape(hidden)
        if shape is None:
            return None
        kind, d = shape
        if kind == "window":
            return ("window", f"each query sees {d} keys, itself included")
        return ("mask", f"a triangular mask ({how})")

    def _fused_masks(self, core: Core) -> None:
        op = core.fused
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
        bound = dict(zip(names, op.call_args, strict=False))
        bound.update(op.call_kwargs)
        if bound.get("is_causal"):
            self.s.causal = self.s.causal or f"is_causal=True at {op.location}"
        mask = bound.get("attn_mask")
        if isinstance(mask, torch.Tensor):
            if mask.dtype == torch.bool:
                found = self._judge_hidden(~mask, "a boolean attn_mask")
            else:
                m = mask.double()
                finite = m[torch.isfinite(m) & (m > -1e4)]
                if torch.unique(finite).numel() > 2:
                    self._refuse("a position bias passed as attn_mask", op.location)
                found = self._judge_hidden(~torch.isfinite(m) | (m < -1e4), "an additive attn_mask")
            if found is not None:
                kind, detail = found
                if kind == "window":
                    self._refuse(f"a sliding-window mask ({detail})", op.location)
                self.s.causal = self.s.causal or f"{detail} at {op.location}"


_ROLE_WORDS = {
    "q": {"q", "query", "queries", "wq"},
    "k": {"k", "key", "keys", "wk"},
    "v": {"v", "value", "values", "wv"},
    "o": {"o", "out", "output", "wo"},
}


def role_hint(name: str) -> str | None:
    """The role a parameter's name suggests (q, k, v, o): a tie-break, never a verdict."""
    parts = name.lower().split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias", "kernel"):
        parts = parts[:-1]
    words = set(re.split(r"[_\W]+", parts[-1]))
    found = [role for role, w in _ROLE_WORDS.items() if words & w]
    return found[0] if len(found) == 1 else None
