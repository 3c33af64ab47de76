"""Projections read back from the calls that applied them: ``x @ W + b`` whatever the call
(``F.linear``, ``x @ W``, ``addmm`` as GPT-2's ``Conv1D`` does, an ``einsum`` with a kernel,
a weight on either side), whatever holds the parameter."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .compare import close
from .dataflow import Graph, replace_tensor
from .record import Op, tensors_in

__all__ = ["Projection", "LINEAR_OPS", "read_projection", "fold_bias", "fold_sum", "fold_chain"]

T = torch.Tensor

#: calls that can apply a weight to a tensor, or multiply two tensors made from the input
LINEAR_OPS = {
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
    "conv2d",
}


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
    #: the output's axes that are rows (tokens, batch); the others are features
    rows: tuple[int, ...] = ()
    #: the node of the weight argument, for the common calls
    weight_node: int | None = None

    @property
    def width(self) -> int:
        return self.w.shape[1]

    @property
    def source(self) -> str:
        what = "+".join(self.params) if self.params else "a projection"
        return f"{what} ({self.op.name} at {self.op.location})" if self.op.location else what


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


def expand_ellipsis(spec: str, ndim: int, width: int) -> str:
    """``...qd`` with 4 axes -> ``ABqd`` (the broadcast axes as capitals, right-aligned)."""
    if "..." not in spec:
        return spec
    named = len(spec) - 3
    letters = "ABCDEFGHIJKLMNOP"[width - max(ndim - named, 0) : width]
    return spec.replace("...", letters)


def einsum_letters(op: Op) -> tuple[list[str], str, list[T]] | None:
    """An einsum's operand subscripts, its output's, and its operands; ``...`` spelled out
    as capital letters (right-aligned, as einsum broadcasts)."""
    args = op.call_args
    eq = args[0] if args and isinstance(args[0], str) else None
    operands = list(tensors_in(args[1:]))
    if eq is None or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    parts = lhs.split(",")
    if len(parts) != len(operands):
        return None
    width = max(
        (t.dim() - (len(p) - 3) for t, p in zip(operands, parts, strict=True) if "..." in p),
        default=0,
    )
    specs = [expand_ellipsis(p, t.dim(), width) for p, t in zip(parts, operands, strict=True)]
    if "..." in out:
        out = expand_ellipsis(out, width + len(out) - 3, width)
    return specs, out, operands


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
        letters = einsum_letters(op)
        if letters is None:
            return None
        specs, out, operands = letters
        for spec, t in zip(specs, operands, strict=True):
            if t is x:
                return [i for i, c in enumerate(spec) if c not in out]
        return None
    if name == "tensordot" and len(args) >= 2:
        # dims: n (the last n axes of the first, the first n of the second), or two lists
        dims = args[2] if len(args) > 2 else op.call_kwargs.get("dims", 2)
        first = args[0] is x
        if isinstance(dims, int):
            return list(range(x.dim() - dims, x.dim())) if first else list(range(dims))
        if isinstance(dims, (list, tuple)) and len(dims) == 2:
            picked = dims[0] if first else dims[1]
            picked = [picked] if isinstance(picked, int) else list(picked)
            return sorted(d % x.dim() for d in picked)
        return None
    if name in ("conv1d", "conv2d"):  # a 1 x 1 convolution over channels-first input
        w = args[1] if len(args) > 1 else op.call_kwargs.get("weight")
        if isinstance(w, torch.Tensor) and all(s == 1 for s in w.shape[2:]) and args[0] is x:
            return [1]
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


def _einsum_rows(op: Op, x: T) -> list[int] | None:
    """Where an einsum puts the rows of ``x``, by its letters (sizes alone cannot place a
    batch of 2 in ``"BSD,CKDH->CBSKH"``, whose C is 2 too)."""
    letters = einsum_letters(op)
    if letters is None:
        return None
    specs, out, operands = letters
    spec = next((sp for sp, t in zip(specs, operands, strict=True) if t is x), None)
    if spec is None or any(c in out and out.count(c) != 1 for c in spec):
        return None
    return [out.index(c) for c in spec if c in out]


def _rows_first(t: T, rows: list[int]) -> T:
    """``t`` as ``(rows, features)``: its row axes first, the rest flattened in order."""
    rest = [i for i in range(t.dim()) if i not in rows]
    n = math.prod(t.shape[i] for i in rows)
    return t.permute(*rows, *rest).reshape(n, -1)


def _by_basis(op: Op, x: T, made: T) -> tuple[T, T | None, tuple[int, ...]] | None:
    """``(W, b)`` of any call that is affine in ``x`` row by row: re-run it on unit rows.

    The features are the axes the call sums over; the rows, the other axes of ``x``, which
    the output keeps (in whatever place).
    """
    features = _contracted(op, x)
    if features is None or op.func is None:
        return None
    x_rows = [i for i in range(x.dim()) if i not in features]
    where = _einsum_rows(op, x) if op.name == "einsum" else None
    if where is None:
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
                y = op.func(
                    *replace_tensor(op.call_args, x, probe),
                    **replace_tensor(op.call_kwargs, x, probe),
                )
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
    return w, (None if bool((b == 0).all()) else b), tuple(where)


def read_projection(g: Graph, op: Op) -> Projection | None:
    if op.name not in LINEAR_OPS or op.func is None:
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
        else:  # rows are every axis but the last
            found = (w, b, tuple(range(made.dim() - 1)))
    found = found or _by_basis(op, x, made)
    if found is None:
        return None
    w, b, rows = found
    # which arguments were the weight and the bias (for the common calls)
    w_at, b_at = {"linear": (1, 2), "addmm": (2, 0), "matmul": (1, None)}.get(op.name, (None, None))
    w_at, b_at = (1, None) if op.name in ("__matmul__", "mm") else (w_at, b_at)
    wn = g.params_of(op, [op.args[w_at]]) if w_at is not None and w_at < len(op.args) else ()
    bn = g.params_of(op, [op.args[b_at]]) if b_at is not None and b_at < len(op.args) else ()
    node = op.args[w_at] if w_at is not None and w_at < len(op.args) else None
    return Projection(op, w, b, g.params_of(op), tainted[0], wn, bn, rows=rows, weight_node=node)


def fold_bias(g: Graph, op: Op, projs: dict[int, Projection]) -> Projection | None:
    """``x @ W + b`` written as two calls: a parameter added to a projection's output, the
    same for every row, is part of the projection (its bias)."""
    if op.name not in ("add", "__add__", "__radd__", "add_") or len(op.args) != 2:
        return None
    made = [a for a in op.args if a in projs]
    other = [a for a in op.args if a not in projs]
    if len(made) != 1 or len(other) != 1 or not g.param[other[0]]:
        return None
    p, out = projs[made[0]], g.ops[made[0]].output
    if op.output.shape != out.shape or not p.rows:
        return None
    try:
        bias = torch.broadcast_to(g.ops[other[0]].output, out.shape)
    except RuntimeError:
        return None
    per_row = _rows_first(bias.detach().double(), list(p.rows))
    if per_row.shape[1] != p.width or not bool((per_row == per_row[0]).all()):
        return None  # not one vector for every row: not a bias
    b = per_row[0] + (0 if p.b is None else p.b)
    names = g.params_of(op, [other[0]])
    return Projection(
        op, p.w, b, (*p.params, *names), p.input_node, p.weight_names, names, rows=p.rows
    )


#: calls that pass a tensor on unchanged (in evaluation): a projection of one stays linear
_PASS = {"dropout", "contiguous", "clone", "detach"}


_SCALE_OPS = {"mul", "__mul__", "__rmul__", "div", "__truediv__"}


def constant_factor(g: Graph, op: Op, node: int) -> float | None:
    """The one number ``op`` multiplies (or divides) ``node`` by: a Python number or a
    one-element tensor made from neither the input nor anything varying; else None."""
    if op.name not in _SCALE_OPS or op.args.count(node) != 1 or len(op.call_args) != 2:
        return None
    if any(g.tainted[a] for a in op.args if a != node):
        return None
    shape = g.ops[node].output.shape
    # the projection is the operand with its shape; the factor, the one-element other
    at = next((i for i, c in enumerate(op.call_args) if _shaped(c, shape)), None)
    if at is None or _shaped(op.call_args[1 - at], shape):
        return None
    other = op.call_args[1 - at]
    if isinstance(other, torch.Tensor):
        if other.numel() != 1:
            return None
        other = float(other)
    if not isinstance(other, (int, float)) or isinstance(other, bool) or other == 0:
        return None
    if op.name in ("div", "__truediv__"):
        return 1.0 / other if at == 0 else None  # c / (W x) is not linear
    return float(other)


def _shaped(c: object, shape: torch.Size) -> bool:
    return isinstance(c, torch.Tensor) and c.shape == shape and c.numel() != 1


def _only_user(g: Graph, node: int, user: int) -> bool:
    return [o.index for o in g.ops[node + 1 :] if node in o.args] == [user]


def _summand(g: Graph, node: int, projs: dict[int, Projection]) -> tuple[Projection, int] | None:
    """A projection as one term of a sum: itself, or one read by nothing but a constant
    factor (LoRA's ``B(A(x)) * scaling``): the projection so scaled and the node it was."""
    if node in projs:
        return projs[node], node
    op = g.ops[node]
    inner = [a for a in op.args if a in projs]
    if len(inner) != 1 or not _only_user(g, inner[0], node):
        return None
    factor = constant_factor(g, op, inner[0])
    if factor is None:
        return None
    p = projs[inner[0]]
    b = None if p.b is None else p.b * factor
    return (
        Projection(op, p.w * factor, b, p.params, p.input_node, rows=p.rows),
        inner[0],
    )


def _passed(g: Graph, node: int) -> int:
    """``node`` traced back through calls that pass a tensor on unchanged (dropout)."""
    while g.ops[node].name in _PASS and len(g.ops[node].args) == 1:
        node = g.ops[node].args[0]
    return node


def fold_sum(
    g: Graph, op: Op, projs: dict[int, Projection]
) -> tuple[Projection, tuple[int, ...]] | None:
    """Two projections of one input added (a weight plus a low-rank adapter, LoRA's
    ``W x + B A x * scaling``, the adapter's input passed through dropout): one projection,
    their weights and biases summed; with the nodes it takes the place of."""
    if op.name not in ("add", "__add__", "__radd__") or len(op.args) != 2:
        return None
    if op.args[0] == op.args[1]:
        return None
    terms = [_summand(g, n, projs) for n in op.args]
    if terms[0] is None or terms[1] is None:
        return None
    (a, a_node), (b, b_node) = terms
    if _passed(g, a.input_node) != _passed(g, b.input_node):
        return None
    if a.w.shape != b.w.shape or a.rows != b.rows:
        return None
    if op.output.shape != a.op.output.shape or op.output.shape != b.op.output.shape:
        return None
    bias = (
        None
        if a.b is None and b.b is None
        else (0 if a.b is None else a.b) + (0 if b.b is None else b.b)
    )
    # the input itself, not the dropout the adapter's copy went through
    x = a.input_node if b.input_node != _passed(g, a.input_node) else b.input_node
    summed = Projection(op, a.w + b.w, bias, (*a.params, *b.params), x, rows=a.rows)
    return summed, (a_node, b_node)


def fold_chain(g: Graph, p: Projection, projs: dict[int, Projection]) -> int | None:
    """The projection whose whole output ``p`` reads, and nothing else reads, narrower
    than both its input and ``p``'s output (a low-rank factorisation ``B(A(x))``, LoRA's
    adapter, with no function between): its node, or None."""
    path = [p.op.index, p.input_node]  # back from p to the projection it reads
    while path[-1] not in projs:
        op = g.ops[path[-1]]
        if op.name not in _PASS or len(op.args) != 1 or not g.tainted[op.args[0]]:
            return None
        path.append(op.args[0])
    first = projs[path[-1]]
    if not first.rows or first.w.shape[1] != p.w.shape[0]:
        return None
    if first.w.shape[1] >= min(first.w.shape[0], p.w.shape[1]):
        return None  # not a bottleneck (a low rank): two layers, such as an embedder's
    for later, node in itertools.pairwise(path):
        if not _only_user(g, node, later):
            return None  # read elsewhere too: not only a step on the way
    return path[-1]


def composed(first: Projection, then: Projection) -> Projection:
    """``then`` applied to what ``first`` made, as one projection of ``first``'s input."""
    w = first.w @ then.w
    b = then.b
    if first.b is not None:
        b = first.b @ then.w + (0 if then.b is None else then.b)
    return Projection(
        then.op, w, b, (*first.params, *then.params), first.input_node, rows=then.rows
    )
