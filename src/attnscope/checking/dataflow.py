"""The record of a call as a dataflow graph: which nodes were made from the probe input,
which from parameters, and how they connect."""

from __future__ import annotations

import torch

from .record import Op, Recorder

__all__ = ["Graph", "HANDED", "LAYOUT_OPS", "replace_tensor"]

T = torch.Tensor

#: calls that only move, cut or copy entries: a query stays a query through them
LAYOUT_OPS = {
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


#: the leaf name prefix (after ``param:``) of a tensor a model hands a layer that it made
#: from its trainable parameters alone (see :meth:`.model.ModelHost.learned_arguments`)
HANDED = "handed:"


class Graph:
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
        leaves = (self.ops[i].leaf or "" for i in self.ancestors(node))
        return {leaf for leaf in leaves if leaf.startswith("input")}

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

    def frozen(self, node: int) -> bool:
        """Whether every parameter a node was made from is frozen (``requires_grad=False``:
        a table of constants kept as a parameter, ALiBi slopes as BTLM's), so that what it
        makes is fixed, not learned."""
        seen, stack, leaves = set(), [node], []
        while stack:
            i = stack.pop()
            if i in seen or not self.param[i]:
                continue
            seen.add(i)
            leaf = self.ops[i].leaf
            if leaf is not None and leaf.startswith("param:" + HANDED):
                return False  # made by the model from its trainable parameters: learned
            if leaf is not None and leaf.startswith("param:"):
                leaves.append(self.original(i))
            stack.extend(self.ops[i].args)
        return bool(leaves) and not any(t.requires_grad for t in leaves)

    def learned(self, node: int) -> bool:
        """Made from trainable parameters (and not from the input): a parameter, or what one
        makes, not every one of them frozen."""
        return bool(self.param[node]) and not self.frozen(node)

    def original(self, node: int) -> T:
        """The tensor as the target had it (not the recorded detached alias)."""
        return self.rec._alive[node]

    def ancestors(self, node: int, stop: set[int] | None = None, every: bool = False) -> set[int]:
        """The nodes a node was made from, itself included: through tensors made from the
        input (``every``: through all), not past the nodes in ``stop``."""
        seen, stack = set(), [node]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if stop and i in stop:
                continue
            stack.extend(a for a in self.ops[i].args if every or self.tainted[a])
        return seen

    def descendants(self, node: int) -> set[int]:
        """The nodes made from a node, itself included."""
        out = {node}
        for op in self.ops[node + 1 :]:
            if any(a in out for a in op.args):
                out.add(op.index)
        return out


def replace_tensor(obj, old: T, new: T):
    if obj is old:
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(replace_tensor(o, old, new) for o in obj)
    if isinstance(obj, dict):
        return {k: replace_tensor(v, old, new) for k, v in obj.items()}
    return obj
