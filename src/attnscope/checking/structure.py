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

import ast
import dataclasses
import linecache
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import AttnScopeError
from .dataflow import LAYOUT_OPS, Graph
from .features import MASKING_OPS, Features, Unsupported, mask_shape
from .layer import Core, Structure
from .projections import (
    Projection,
    composed,
    einsum_letters,
    fold_bias,
    fold_chain,
    fold_sum,
    read_projection,
)
from .record import ModuleCall, Op, Recorder, tensors_in

__all__ = [
    "SeveralLayers",
    "attention_cores",
    "attention_layers",
    "Core",
    "Structure",
    "read_structure",
    "projection_input",
    "keys_named_first",
    "stage_of",
    "role_hint",
    "Unsupported",
    "Projection",
]

T = torch.Tensor

#: calls that join tensors into one (heads' contexts concatenated)
_JOINING = {"cat", "concat", "concatenate", "stack", "hstack"}
#: calls a head's context passes through unchanged in meaning on its way to being joined
_PASSING = {"dropout", "feature_dropout", "alpha_dropout", "clone", "to", "float", "type_as"}
#: pairwise sums: scores made of them are additive attention's
_ADDITIVE = {"add", "__add__", "__radd__", "add_"}
#: calls that normalise scores into weights (or try to: the mistakes' stand-ins too)
_NORMALISING = {"softmax", "_softmax", "softmax_", "log_softmax", "exp", "exp_", "exp2", "sigmoid"}
_NORMALISING |= {"div", "div_", "__truediv__", "true_divide", "normalize", "relu", "relu_"}
_PRODUCT = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "einsum", "tensordot"}
#: products with a term added (``baddbmm(added, a, b)``): their parameter names, in order
_ADDED_PRODUCT = {"baddbmm": ["input", "batch1", "batch2"], "addmm": ["input", "mat1", "mat2"]}


# ------------------------------------------------------------------------------ the core


def _einsum_sides(op: Op) -> tuple[int, int, int] | None:
    """For a two-operand einsum: (query operand, key operand, contracted size)."""
    letters = einsum_letters(op)
    if letters is None or len(letters[0]) != 2:
        return None
    (a, b), out, operands = letters
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


def _einsum_operands(g: Graph, op: Op) -> tuple[int, int] | None:
    """The nodes of a two-operand einsum's operands made from the input, or None."""
    if op.name != "einsum" or op.position != 0:
        return None
    nodes = [n for n in op.args if g.tainted[n]]
    return (nodes[0], nodes[1]) if len(nodes) == 2 and nodes[0] != nodes[1] else None


def _pairwise_sides(g: Graph, op: Op) -> tuple[int, int, int] | None:
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


def _product_sides(g: Graph, op: Op) -> tuple[int, int, int] | None:
    """(query-side node, key-side node, contracted size) of a product of two tensors."""
    tensors = list(tensors_in(op.call_args)) + list(tensors_in(op.call_kwargs))
    nodes = op.args
    if len(tensors) != len(nodes):
        return None
    pairs = [(t, n) for t, n in zip(tensors, nodes, strict=True) if g.tainted[n]]
    if op.name in _ADDED_PRODUCT:
        # baddbmm(added, a, b) = beta * added + alpha * a @ b: the added term (a padding
        # bias, often made from the input's shape as x.new_zeros) is no operand
        named = _named_nodes(op, _ADDED_PRODUCT[op.name])
        keep = [named.get(n) for n in _ADDED_PRODUCT[op.name][1:]]
        if None in keep:
            return None
        by_node = {m: t for t, m in zip(tensors, nodes, strict=True)}
        pairs = [(by_node[n], n) for n in keep if g.tainted[n]]
    if op.name == "einsum":
        sides = _einsum_sides(op)
        if sides is None or len(pairs) != 2:
            return None
        (ta, na), (tb, nb) = pairs[sides[0]], pairs[sides[1]]
        size = sides[2]
    else:
        if len(pairs) == 1 and len(nodes) >= 2 and nodes.count(pairs[0][1]) >= 2:
            pairs = [pairs[0], pairs[0]]  # x @ x.T written on one tensor
        if len(pairs) != 2:
            return None
        (ta, na), (tb, nb) = pairs
        if op.name == "__rmatmul__":
            (ta, na), (tb, nb) = (tb, nb), (ta, na)
        size = ta.shape[-1] if ta.dim() else 1
    if ta.is_complex() or tb.is_complex():
        # complex operands (pairs of features viewed as complex numbers): the real tensors
        # they view are the operands, each complex entry two features; whether the product
        # is a dot product (one side conjugated, the real part taken) the judge sees
        ra, rb = _real_view(g, na), _real_view(g, nb)
        if ra is None or rb is None:
            return None
        return ra, rb, 2 * size
    return na, nb, size


def _whole_heads(cut: T, head_dim: int) -> bool:
    """Whether the columns ``cut`` reads are heads of ``head_dim`` adjacent columns each,
    heads in order (no head cut across the features)."""
    heads = cut.view(-1, head_dim) if cut.numel() % head_dim == 0 else None
    if heads is None or not torch.equal(
        heads - heads[:, :1], torch.arange(head_dim).expand_as(heads)
    ):
        return False
    return heads.shape[0] < 2 or bool((heads[1:, 0] > heads[:-1, 0]).all())


def _swapped(obj, swap: dict[int, T]):
    """A call's arguments with the tensors in ``swap`` (by id) replaced."""
    if isinstance(obj, torch.Tensor):
        return swap.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swapped(o, swap) for o in obj)
    if isinstance(obj, dict):
        return {k: _swapped(v, swap) for k, v in obj.items()}
    return obj


#: calls between a complex view of the queries or keys and the product that takes it
_COMPLEX_LAYOUT = {"conj", "resolve_conj", "conj_physical"}


def _real_view(g: Graph, node: int) -> int | None:
    """The real tensor a complex operand views (``view_as_complex``'s argument), up through
    layout calls and conjugation; None where it is made otherwise."""
    i = node
    for _ in range(16):
        op = g.ops[i]
        parents = g.tainted_args(op)
        if len(parents) != 1:
            return None
        if op.name == "view_as_complex":
            return parents[0]
        if op.name not in LAYOUT_OPS and op.name not in _COMPLEX_LAYOUT:
            return None
        i = parents[0]
    return None


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


class SeveralLayers(AttnScopeError):
    """The target holds several attention layers in a row: a model, checked layer by layer.
    ``second``: the name of the optional input of its forward that, handed another
    sequence, runs them (a decoder block's ``encoder_hidden_states``), where it takes one."""

    second: str | None = None


def attention_layers(rec: Recorder, root: nn.Module) -> list[str]:
    """The module paths of the attention layers a recorded call of a model ran, in order."""
    return _Reader(rec, root).layers()


def attention_cores(rec: Recorder, root: nn.Module) -> list[Core]:
    """Every attention core (scores and context products, or a fused call) of a recorded
    call, in run order, with the nodes of its queries, keys and values."""
    return _Reader(rec, root)._scan()[0]


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
        self.g = Graph(rec)
        self.ops = rec.ops
        self.block: tuple[int, int] | None = None
        #: how many sequences each weight was applied to one by one (1: the batch at once)
        self.copies = 1
        #: a projection's output values sorted, with their columns (see _sorted_columns)
        self._sorted: dict[int, tuple[T, T] | None] = {}

    # -- projections and the core
    def layers(self, scanned: tuple | None = None) -> list[str]:
        """The dotted module path of every attention layer the record ran, in run order:
        cores of products or fused calls, and ``nn.MultiheadAttention`` calls (the
        innermost submodule call around each ``multi_head_attention_forward``).
        ``scanned``: what :meth:`_scan` returned, where it already ran."""
        cores, projs, _, _ = scanned or self._scan()
        found: list[tuple[int, str]] = []
        unnormalised: set[str] = set()
        joined = self._joined_heads(cores, projs)
        for core in cores:
            group = joined.get(id(core), [core])
            roles = {
                r: [p for c in group for p in self._projections_above(n, projs)]
                for r, n in (("q", core.q_node), ("k", core.k_node), ("v", core.v_node))
                if n is not None
            }
            call = self._layer_call(group, roles)
            op = core.fused or core.score
            path = "" if call is None else call.path
            found.append((op.index if op is not None else 0, path))
            if not self._normalised(core):
                unnormalised.add(path)
        for op in self.ops:
            if op.name != "multi_head_attention_forward" or op.position != 0:
                continue
            if not self.g.tainted[op.index]:
                continue
            around = [c for c in self.rec.modules if c.path and c.start <= op.index < c.end]
            inner = max(around, key=lambda c: c.depth, default=None)
            found.append((op.index, "" if inner is None else inner.path))
        paths: list[str] = []
        for _, path in sorted(found):
            if path not in paths:
                paths.append(path)
        # a token-mixing product with nothing normalising it between scores and context (a
        # state-space mixer's C B^T times its decays, Mamba 2's) is not an attention layer,
        # unless a layer of its class normalises (a slip that dropped the softmax)
        kinds = {type(self._module_at(p)) for p in paths if p and p not in unnormalised}
        return [
            p for p in paths if p not in unnormalised or not p or type(self._module_at(p)) in kinds
        ]

    def _joined_heads(self, cores: list[Core], projs) -> dict[int, list[Core]]:
        """Cores computed apart (one module per head) whose contexts, as they are or merely
        reshaped, are concatenated into one tensor that a projection then reads: one layer
        (a multi-head module of single-head modules). ``id(core)`` -> every core so joined."""
        by_join: dict[int, list[Core]] = {}
        for core in cores:
            end = core.fused or core.context
            if end is None:
                continue
            reach, join = {end.index}, None
            for op in self.ops[end.index + 1 :]:
                if not any(a in reach for a in op.args):
                    continue
                if op.name in _JOINING:
                    join = op.index
                    break
                if op.name in LAYOUT_OPS or op.name in _PASSING:
                    reach.add(op.index)
            if join is not None:
                by_join.setdefault(join, []).append(core)
        out: dict[int, list[Core]] = {}
        for join, group in by_join.items():
            if len(group) < 2:
                continue
            below = self.g.descendants(join)
            if not any(i in below and p.input_node in below | {join} for i, p in projs.items()):
                continue
            for core in group:
                out[id(core)] = group
        return out

    def _module_at(self, path: str) -> nn.Module | None:
        try:
            return self.root.get_submodule(path)
        except AttributeError:
            return None

    def _normalised(self, core: Core) -> bool:
        """Whether anything between the scores and the context normalises them: a softmax
        (a call, or exp and a division), a sigmoid, a division; a fused call does."""
        if core.score is None or core.context is None:
            return True
        reach = {core.score.index}
        for op in self.ops[core.score.index + 1 : core.context.index]:
            if any(a in reach for a in op.args):
                reach.add(op.index)
                if op.name in _NORMALISING:
                    return True
        return False

    def read(self) -> Structure:
        scanned = self._scan()
        cores, projs, after_context, mha = scanned
        if mha is not None:
            if len(self.layers(scanned)) > 1:  # nn.TransformerEncoder: one a layer
                raise SeveralLayers(
                    "holds several attention layers, one after the other (a whole model)"
                )
            return self._from_mha(mha, after_context)
        added = next(
            (c.score for c in cores if c.score is not None and c.score.name in _ADDITIVE), None
        )
        if added is not None:  # a per-query term plus a per-key term, broadcast: no product
            raise Unsupported(
                "not supported yet: additive attention (scores made by adding a term of each "
                "query to a term of each key, not by a dot product: GAT's or Bahdanau's) at "
                f"{added.location}"
            )
        linear = self._keys_times_values()
        if linear is not None and (
            not cores
            or any(
                linear.index in self.g.ancestors(op.index)
                for c in cores
                for op in (c.score, c.context)
                if op is not None
            )
        ):  # what reads as attention is the queries times k'^T v (or its normaliser)
            raise Unsupported(
                "not supported yet: two tensors made from the input multiplied over the "
                "tokens, so no token-by-token weights are made (linear attention's k'^T v, "
                "a kernel or random-feature approximation of the softmax as Performer's; or "
                f"features attending to features, as XCiT's) at {linear.location}"
            )
        if not cores:
            raise AttnScopeError(
                "found no attention in its computation: expected a product of two tensors made "
                "from the input (the scores), then a product of what they became with a third "
                "(the context), or a call of scaled_dot_product_attention"
            )
        return self._assemble(cores, projs, after_context)

    def _keys_times_values(self) -> Op | None:
        """A product of two tensors made from the input, each as large as the tokens make
        it, whose output is not (``k'^T v``, ``(..., d, e)``: its size does not grow with
        the tokens, which a product that keeps or folds a tokens axis does)."""
        first = next((op for op in self.ops if op.leaf == "input:0"), None)
        if first is None or first.output.dim() != 3:
            return None
        n = first.output.shape[1]
        # what a product of two tensors made from the input made (scores, weights): a chunk
        # of queries' weights times the values keeps no whole tokens axis, and is no k'^T v
        scored: set[int] = set()
        for op in self.ops:
            if any(a in scored for a in op.args):
                scored.add(op.index)
                continue
            if op.name not in _PRODUCT or len(self.g.tainted_args(op)) < 2:
                continue
            sizes = [self.ops[a].output.numel() for a in self.g.tainted_args(op)]
            out = op.output
            if out.dim() >= 2 and out.numel() % n and not any(size % n for size in sizes):
                return op
            scored.add(op.index)
        return None

    def _scan(self):
        """Projections and cores (scores and context products, fused calls) in the record."""
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
                # a context, as the explicit product's below: a next layer's scores may be
                # made from it (a fused layer before an explicit one)
                after_context[i] = True
                after_score[i] = core is None
                continue
            proj = read_projection(g, op)
            if proj is not None:  # applied to another's whole output: one projection
                first = fold_chain(g, proj, projs)
                if first is not None:
                    proj = composed(projs.pop(first), proj)
            if proj is None:
                proj = fold_bias(g, op, projs)
                if proj is not None:  # the bias joins the projection it follows
                    projs.pop(next(a for a in op.args if a in projs))
            if proj is None:
                summed = fold_sum(g, op, projs)
                if summed is not None:  # two projections of one input added: one
                    proj, parts = summed
                    for a in parts:
                        projs.pop(a)
            if proj is not None:
                projs[i] = proj
                if after_context[i]:
                    # a context projected (a layer's output): no longer scores, even where it
                    # was rescaled by factors made from them (an online softmax's running
                    # maximum and sum): a next layer's scores may be made from it
                    after_score[i] = False
                continue
            if op.position != 0:
                continue
            sides = _product_sides(g, op) if op.name in _PRODUCT else _pairwise_sides(g, op)
            if sides is None:
                # an einsum of the weights with a third tensor that contracts no axis the
                # two share ("bhqk,bhqd->bhqd": the keys' axis summed away on its own): a
                # context product written wrong, the layer's all the same
                pair = _einsum_operands(g, op)
                if pair is None or after_score[pair[0]] == after_score[pair[1]]:
                    continue
                sides = (*pair, 0)
            a, b, size = sides
            if not after_score[a] and not after_score[b]:
                if self.ops[a].output.dim() >= 2 and self.ops[b].output.dim() == 1:
                    # keys @ q with q one vector (one query, one head at a time: gemma.cpp's
                    # loops): the vector is the query, the matrix its keys
                    a, b = b, a
                cores.append(Core(a, b, None, size, score=op))
                after_score[i] = True
                # a new layer's scores, not a context: a map of them (talking heads'
                # learned mixing) is no context projected, whatever the queries came from
                after_context[i] = False
            elif after_score[a] != after_score[b]:
                weights, values = (a, b) if after_score[a] else (b, a)
                core = self._core_for(cores, weights)
                if core is not None and core.context is None:
                    core.v_node, core.context = values, op
                    after_context[i] = True
                    # the context is the layer's output, no longer scores: a next layer's
                    # scores may be made from it (a model of several layers)
                    after_score[i] = False
        if mha is None:
            for p in projs.values():
                p.companion = self._companion(p)
        cores = [c for c in cores if c.fused is not None or c.context is not None]
        return cores, projs, after_context, mha

    def _companion(self, p: Projection) -> tuple[str, T] | None:
        """The bias that belongs with a projection's weight, where the call applied another
        (or none): the same Linear's ``bias``, or a bare parameter paired with the weight
        (``q_w``/``q_b``, ``W_q``/``b_q``, ``wq``/``bq``, ``q_weight``/``q_bias``); for a
        weight concatenated from several (``cat([q.weight, k.weight, v.weight])``), their
        biases in the same order."""
        pieces = self._concatenated(p) or list(p.weight_names)
        if not pieces or (len(pieces) > 1 and not self._concatenated(p)):
            return None
        found = [self._bias_for(name) for name in pieces]
        if any(b is None for b in found) or sum(b[1].numel() for b in found) != p.width:
            return None
        if len(found) == 1 and p.bias_names == (found[0][0],):
            return None  # it applied its own
        bias = torch.cat([b for _, b in found])
        if len(found) > 1 and p.b is not None and torch.equal(p.b, bias):
            return None
        return "+".join(n for n, _ in found), bias

    def _concatenated(self, p: Projection) -> list[str]:
        """The parameters a weight was concatenated from, in order (empty if it was not)."""
        node = p.weight_node
        if node is None or self.ops[node].name != "cat":
            return []
        names = [self.g.params_of(self.ops[node], [a]) for a in self.ops[node].args]
        return [n[0] for n in names] if all(len(n) == 1 for n in names) else []

    def _bias_for(self, name: str) -> tuple[str, T] | None:
        owner, _, last = name.rpartition(".")
        prefix = f"{owner}." if owner else ""
        pairs = [(r"^weight$", "bias"), (r"_w$", "_b"), (r"_weight$", "_bias")]
        pairs += [(r"^[wW]_", "b_"), (r"^weight_", "bias_"), (r"^w(?=[a-z])", "b")]
        params = dict(self.root.named_parameters())
        weight = params.get(name)
        for pattern, repl in pairs:
            if not re.search(pattern, last):
                continue
            cand = prefix + re.sub(pattern, repl, last, count=1)
            bias = params.get(cand)
            rows = None if weight is None or weight.dim() != 2 else weight.shape
            if bias is None or bias.dim() != 1 or (rows and bias.shape[0] not in rows):
                continue
            return cand, bias.detach().double()
        return None

    def _chosen_per_token(self, roles: dict[str, list[Projection]]) -> None:
        """Refuse two projections of one input through weights of the same shape whose
        outputs a ``where`` picks between, token by token (CogVLM's visual expert: image and
        text tokens projected by weights of their own): one weighting is no reading of it."""
        names = {"q": "queries", "k": "keys", "v": "values"}
        for role, ps in roles.items():
            alike = [
                p for p in ps if p.w.shape == ps[0].w.shape and p.input_node == ps[0].input_node
            ]
            if len(alike) < 2:
                continue
            made = {p.op.index for p in alike}
            for op in self.ops:
                if op.name not in ("where", "where_") or len(op.args) < 3:
                    continue
                picked = [a for a in op.args[1:] if self.g.ancestors(a) & made]
                if len(picked) >= 2:
                    raise Unsupported(
                        f"not supported yet: the {names[role]} made by one of several weights "
                        "of the same shape, picked token by token (token-type experts: "
                        f"CogVLM's visual expert?) at {op.location}"
                    )

    def _core_for(self, cores: list[Core], weights: int) -> Core | None:
        """The scores product a weights tensor was made from (the latest one)."""
        anc = self.g.ancestors(weights)
        for core in reversed(cores):
            if core.score is not None and core.score.index in anc:
                return core
        return None

    def _projections_above(self, node: int, projs: dict[int, Projection]) -> list[Projection]:
        """The projections nearest above a node (not past one), in index order."""
        found = self.g.ancestors(node, stop=set(projs))
        return [projs[i] for i in sorted(found) if i in projs]

    # -- roles, heads, layer
    def _assemble(self, cores, projs, after_context) -> Structure:
        # a projection of no token at all (an expert no token was routed to: CogVLM's
        # vision expert on text) makes nothing the attention reads
        projs = {i: p for i, p in projs.items() if p.op.output.numel() > 0} or projs
        roles: dict[str, list[Projection]] = {"q": [], "k": [], "v": []}
        for core in cores:
            for role, node in (("q", core.q_node), ("k", core.k_node), ("v", core.v_node)):
                for p in self._projections_above(node, projs):
                    if all(p.op.index != o.op.index for o in roles[role]):
                        roles[role].append(p)
        self._chosen_per_token(roles)
        applied = {p.op.index for ps in roles.values() for p in ps}
        once = {r: _per_sequence_once(ps) for r, ps in roles.items()}
        self.copies = max((len(roles[r]) // max(len(once[r]), 1) for r in roles), default=1)
        roles = once
        repeats = applied - {p.op.index for ps in roles.values() for p in ps}
        call = self._layer_call(cores, roles)
        span = (call.start, call.end) if call is not None else (0, len(self.ops))
        if self._sequential(cores):
            raise SeveralLayers(
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
        if _keys_first(roles, shared, widths):
            # the scores' first operand is made by the narrower projection, as wide as the
            # values: keys @ queries^T (kv heads are never more than query heads)
            roles["q"], roles["k"] = roles["k"], roles["q"]
            widths = {**widths, "q": widths["k"], "k": widths["q"]}
            cores = [dataclasses.replace(c, q_node=c.k_node, k_node=c.q_node) for c in cores]
        if cores[0].fused is not None and cores[0].fused.output.dim() >= 3:
            q_arg = self.ops[cores[0].q_node].output
            k_arg = self.ops[cores[0].k_node].output
            if q_arg.dim() == 4:
                heads, kv_heads = q_arg.shape[1], k_arg.shape[1]
        if heads is None and widths["q"] and head_dim and widths["q"] % head_dim == 0:
            heads = widths["q"] // head_dim
        if widths["k"] and head_dim and widths["k"] % head_dim == 0:
            # from the keys' projection: repeat_kv may have widened them before the product
            kv_heads = widths["k"] // head_dim
        input_node = roles["q"][0].input_node if roles["q"] else cores[0].q_node
        s = Structure(
            layer=call.path if call is not None else "",
            call=call,
            input_node=input_node,
            roles=roles,
            shared=shared,
            out=out if out is not None and span[0] <= out.op.index < span[1] else None,
            unused=self._unused(call, span, cores),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            cores=cores,
            widths=widths,
            block=self.block,
        )
        s.repeats = repeats
        s.pre = self._pre(s)
        if shared.get("k") == "q" and shared.get("v") == "q" and head_dim:
            s.cuts = self._cuts(roles["q"], cores, widths, head_dim)
        Features(self.g, s).find()
        return s

    def _cuts(self, projs, cores, widths, head_dim) -> dict[str, T] | None:
        """The columns of one combined projection each role reads (see
        :attr:`Structure.cuts`): the projection's output replaced by the index of each
        entry and the layout calls on the way to each operand run again on it. Taken only
        where every row is cut alike, each head is a run of adjacent columns, heads in
        order, and the roles share out every column once."""
        if len(projs) != 1:
            return None
        p = projs[0]
        out = self.ops[p.op.index].output
        feats = [i for i in range(out.dim()) if i not in p.rows]
        if not p.rows or feats != list(range(out.dim() - len(feats), out.dim())):
            return None
        width = p.width
        n_rows = out.numel() // max(width, 1)
        cuts: dict[str, T] = {}
        for core in cores:
            for role, node in (("q", core.q_node), ("k", core.k_node), ("v", core.v_node)):
                cut = None if node is None else self._traced(p.op.index, node, widths.get(role))
                if cut is None or (role in cuts and not torch.equal(cuts[role], cut)):
                    return None
                cuts[role] = cut
        whole = torch.cat(list(cuts.values()))
        if not torch.equal(whole.sort().values, torch.arange(width)):
            return None
        # the roles side by side in each column (alpa's (heads, head_dim, 3)): each role's
        # columns every n-th, at an offset of its own; its heads judged within its share
        n = len(cuts)
        apart = {int(c[0]) % n for c in cuts.values()}
        woven = len(apart) == n and all(bool((c % n == c[0] % n).all()) for c in cuts.values())
        if not all(_whole_heads(c, head_dim) for c in cuts.values()) and not (
            woven and all(_whole_heads(c // n, head_dim) for c in cuts.values())
        ):
            return None
        return cuts if n_rows else None

    def _traced(self, start: int, node: int, width: int | None) -> T | None:
        """The columns (of the projection output at ``start``, features last) that the
        last layout-only descendant of it above ``node`` holding ``width`` features per
        row reads, in its own order."""
        if not width:
            return None
        out = self.ops[start].output
        total = out.shape[-1] if out.dim() else 0
        if not total or out.numel() >= 2**52:
            return None
        n_rows = out.numel() // total
        env = {start: torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape)}
        above = self.g.ancestors(node)
        found = None
        for op in self.ops[start + 1 : node + 1]:
            if op.index not in above or op.name not in LAYOUT_OPS or op.func is None:
                continue
            parents = self.g.tainted_args(op)
            if not parents or any(a not in env for a in parents):
                continue
            swap = {id(self.g.original(a)): env[a] for a in parents}
            try:
                made = op.func(*_swapped(op.call_args, swap), **_swapped(op.call_kwargs, swap))
            except Exception:  # a call that does not take a float64 stand-in: not traced
                continue
            if isinstance(made, (tuple, list)):
                made = made[op.position] if op.position < len(made) else None
            if not isinstance(made, torch.Tensor) or made.shape != op.output.shape:
                continue
            env[op.index] = made
            if made.numel() == n_rows * width:
                found = made
        if found is None:
            return None
        flat = found.detach().reshape(-1)
        if not bool((flat == flat.round()).all()):
            return None
        flat = flat.long()
        row, col = flat // total, flat % total
        if not torch.equal(torch.bincount(row, minlength=n_rows), torch.full((n_rows,), width)):
            return None
        cols = col[torch.sort(row, stable=True).indices].view(n_rows, width)
        return cols[0].clone() if bool((cols == cols[:1]).all()) else None

    def _unviewed(self, node: int) -> int:
        """``node`` traced back through views of one tensor (``x.view(*x.shape[:2], -1)``)."""
        while self.ops[node].name in LAYOUT_OPS and len(self.g.tainted_args(self.ops[node])) == 1:
            node = self.g.tainted_args(self.ops[node])[0]
        return node

    def _pre(self, s: Structure) -> list[Op]:
        """Transforms of the input inside the layer before the projections (not layout)."""
        if s.input_node is None or not s.roles["q"]:
            return []
        start = s.call.start if s.call is not None else 0
        inputs = {self._unviewed(p.input_node) for ps in s.roles.values() for p in ps}
        q_in = {self._unviewed(p.input_node) for p in s.roles["q"]}
        if len(inputs) != 1 and len(q_in) == 1:
            # cross-attention: keys and values from another input; the queries' own
            # transform (SmolVLA's expert norms its hidden states, not the VLM's) is the pre
            q_roots = self.g.roots(next(iter(q_in)))
            if not any(self.g.roots(n) & q_roots for n in inputs - q_in):
                inputs = q_in
        if len(inputs) != 1:
            # the projections read different transforms of one input: not modelled (a
            # verdict would hold the layer to a reference fed the input as it came)
            for node in sorted(inputs):
                made = [
                    self.ops[i]
                    for i in sorted(self.g.ancestors(node))
                    if i >= start and self.ops[i].leaf is None
                ]
                moved = [op for op in made if op.name not in LAYOUT_OPS]
                if moved:
                    s.unmodelled.append(
                        (
                            "projections that read different transforms of the input "
                            f"({moved[0].name} on the way to one of them)",
                            moved[0].location,
                        )
                    )
                    break
            return []
        found = [
            self.ops[i]
            for i in sorted(self.g.ancestors(s.input_node))
            if i >= start and self.ops[i].leaf is None
        ]
        return found if any(op.name not in LAYOUT_OPS for op in found) else []

    def _widths(self, roles, shared, cores) -> dict[str, int]:
        """How many features each role has, all heads together. One combined weight is cut
        by what the queries read from it (a multi-query weight is not cut in thirds)."""
        total = {r: sum(p.width for p in roles[r]) for r in ("q", "k", "v")}
        if not shared:
            return total
        read = self._read_width(roles["q"], [c.q_node for c in cores])
        if shared.get("k") == "q" and shared.get("v") == "q":
            block = self._attention_block(roles["q"], cores)
            if block is not None:  # the weight also makes something else (a feed-forward)
                self.block = block[0]
                return block[1]
            rest = total["q"] - read
            return {"q": read, "k": rest // 2, "v": rest // 2}
        if shared.get("v") == "k":
            return {"q": total["q"], "k": total["k"] // 2, "v": total["k"] // 2}
        return {"q": read, "k": total["q"] - read, "v": total["v"]}

    def _attention_block(self, projs: list[Projection], cores: list[Core]):
        """One weight making queries, keys, values and more (a parallel block's fused
        attention and feed-forward projection): the block of its columns that reaches the
        scores and context products, and each role's width in it; None when the roles
        read all its columns, or the columns cannot be told."""
        if len(projs) != 1:
            return None
        p = projs[0]
        read = sum(
            self._read_width(
                projs, [n for c in cores if (n := getattr(c, f"{r}_node")) is not None]
            )
            for r in ("q", "k", "v")
        )
        if read == p.width:  # the roles read every column, once: no block to cut
            return None
        cols = {}
        for role, nodes in (
            ("q", [c.q_node for c in cores]),
            ("k", [c.k_node for c in cores]),
            ("v", [c.v_node for c in cores]),
        ):
            found: set[int] = set()
            for node in nodes:
                got = None if node is None else self._columns(p, node)
                if got is None:
                    return None
                found |= got
            cols[role] = found
        union = cols["q"] | cols["k"] | cols["v"]
        if sum(len(c) for c in cols.values()) != len(union) or len(union) >= p.width:
            return None  # overlapping, or every column: the usual readings apply
        lo, hi = min(union), max(union) + 1
        if hi - lo != len(union):
            return None
        return (lo, hi), {r: len(c) for r, c in cols.items()}

    def _columns(self, p: Projection, node: int) -> set[int] | None:
        """The output columns of projection ``p`` that reach ``node``: found by value in the
        pieces cut from its output (by layout calls only) on the way to ``node``."""
        g, ops = self.g, self.ops
        start = p.op.index
        anc = g.ancestors(node)
        if start not in anc or p.op.stale or not p.rows:
            return None
        cut = {start}
        for i in sorted(anc):
            op = ops[i]
            if i <= start or op.name not in LAYOUT_OPS or op.leaf is not None:
                continue
            others = [a for a in op.args if a not in cut]
            if len(others) < len(op.args) and not any(g.tainted[a] for a in others):
                cut.add(i)
        ends = [i for i in cut if not any(i in ops[j].args for j in cut if j != i)]
        sorted_ = self._sorted_columns(p)
        if sorted_ is None:
            return None
        values, column = sorted_
        found: set[int] = set()
        for i in ends:
            if ops[i].stale or not ops[i].output.is_floating_point():
                return None
            piece = ops[i].output.detach().double().reshape(-1)
            left = torch.searchsorted(values, piece).clamp(max=len(values) - 1)
            right = (torch.searchsorted(values, piece, right=True) - 1).clamp(min=0)
            if not bool((values[left] == piece).all()):
                return None  # not a piece of the projection's output
            plain = column[left] == column[right]  # a value in one column only
            if not bool(plain.any()):
                return None
            found |= set(column[left][plain].tolist())
        return found

    def _sorted_columns(self, p: Projection) -> tuple[T, T] | None:
        """The projection's output values sorted, with the column each came from (made once
        per projection: every role's operand is looked up in it)."""
        cache = self._sorted
        if p.op.index not in cache:
            made = p.op.output.detach().double()
            rest = [i for i in range(made.dim()) if i not in p.rows]
            if len(rest) != 1:
                cache[p.op.index] = None
            else:
                table = made.movedim(rest[0], -1).reshape(-1, made.shape[rest[0]])
                column = torch.arange(table.shape[1]).expand_as(table).reshape(-1)
                by_column = torch.argsort(column, stable=True)
                values, column = table.reshape(-1)[by_column], column[by_column]
                order = torch.argsort(values, stable=True)
                cache[p.op.index] = (values[order], column[order])
        return cache[p.op.index]

    def _read_width(self, projs: list[Projection], nodes: list[int]) -> int:
        """Features per row in the given operands, rows counted as the projections make
        them (a (B, H, T, hd) operand of a (B, T, 3*d) projection reads H*hd)."""
        rows = projs[0].op.output.numel() // projs[0].width
        read = sum(self.ops[n].output.numel() for n in set(nodes)) // max(rows, 1)
        return read // max(self.copies, 1)  # one sequence's operands

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
            if not a or a != b:
                continue
            if earlier == "k":  # keys and values from one call: combined unless one tensor
                reused = all(c.v_node == c.k_node for c in cores)
            else:
                reused = self._reused(roles[earlier], cores)
            if not reused:
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
            anc = self.g.ancestors(core.q_node) | self.g.ancestors(core.k_node)
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
        later = self.g.descendants(first.op.index)
        parallel = _per_sequence_once([p for p in found if p.op.index not in later or p is first])
        if len(parallel) == 1 or any(p.w.shape[1] != first.w.shape[1] for p in parallel):
            return first
        w = torch.cat([p.w for p in parallel], dim=0)
        names = tuple(sorted({n for p in parallel for n in p.params}))
        return Projection(first.op, w, first.b, names, first.input_node)

    def _unused(
        self, call: ModuleCall | None, span, cores: list[Core] = ()
    ) -> list[tuple[str, nn.Module | T]]:
        """Projection weights the layer holds and its computation never read: an output
        projection defined and skipped, or W_key defined while keys were made with W_query.
        A weight whose product goes nowhere (``value = self.to_v(x)`` computed, the weights
        then multiplied by the keys) counts as never read."""
        module = call.module if call is not None else self.root
        prefix = f"{call.path}." if call is not None and call.path else ""
        live = self._live(cores)
        read = set()
        for op in self.ops:
            leaf = op.leaf or ""
            if leaf.startswith("param:") and (live is None or op.index in live):
                read.add(leaf[len("param:") :])
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

    def _live(self, cores: list[Core]) -> set[int] | None:
        """The ops the attention's result depends on: what the cores' contexts were made
        from and everything made after from them (the output projection's weights
        included); None where no core holds a context."""
        ends = [(c.context or c.fused) for c in cores]
        if not ends or any(e is None for e in ends):
            return None
        first = min(e.index for e in ends)
        after = {e.index for e in ends}
        for op in self.ops[first + 1 :]:
            if any(a in after for a in op.args):
                after.add(op.index)
        live, stack = set(), list(after)
        while stack:  # every op those were made from, walked once
            i = stack.pop()
            if i not in live:
                live.add(i)
                stack.extend(self.ops[i].args)
        return live

    # -- torch's own MultiheadAttention
    def _from_mha(self, op: Op, after_context) -> Structure:
        import inspect

        bound = inspect.signature(F.multi_head_attention_forward).bind(
            *op.call_args, **op.call_kwargs
        )
        a = bound.arguments
        f64 = torch.float64
        e, heads = a["embed_dim_to_check"], a["num_heads"]
        nodes = _named_nodes(op, ["query", "key", "value"])
        q_node = op.args[0]
        k_node, v_node = nodes.get("key", op.args[1]), nodes.get("value", op.args[2])
        # each role's parameters by identity (the tensors handed to the call), so that a
        # weight handed twice (keys made with the queries' weight) reads as one projection
        by_id = {id(p): n for n, p in self.root.named_parameters()}

        def proj(w, b, w_of, b_of, node=q_node) -> Projection:
            wn = tuple(n for n in (by_id.get(id(w_of)),) if n)
            bn = tuple(n for n in (by_id.get(id(b_of)),) if n and b_of is not None)
            return Projection(
                op,
                w.detach().to(f64).T,
                None if b is None else b.detach().to(f64),
                wn + bn,
                node,
                weight_names=wn,
                bias_names=bn,
            )

        bias = a.get("in_proj_bias")
        if a.get("use_separate_proj_weight"):
            ws = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
            whole = ws
        else:
            ws = tuple(a["in_proj_weight"][i * e : (i + 1) * e] for i in range(3))
            whole = (a["in_proj_weight"],) * 3
        inputs = (q_node, k_node, v_node)
        bias_of = [None if bias is None else bias[i * e : (i + 1) * e] for i in range(3)]
        roles = {
            r: [proj(w, bias_of[i], whole[i], bias, inputs[i])]
            for i, (r, w) in enumerate(zip(("q", "k", "v"), ws, strict=True))
        }
        out = proj(
            a["out_proj_weight"],
            a.get("out_proj_bias"),
            a["out_proj_weight"],
            a.get("out_proj_bias"),
        )
        call = self._layer_call([Core(q_node, q_node, None, e // heads, fused=op)], roles)
        # weights the layer holds and did not hand over: where a weight handed twice should
        # have come from (one packed in_proj_weight is cut three ways by design)
        handed = {id(v) for v in a.values() if isinstance(v, torch.Tensor)}
        unused = [
            (n, o)
            for n, o in (self._unused(call, None) if a.get("use_separate_proj_weight") else [])
            if id(o) not in handed and id(getattr(o, "weight", None)) not in handed
        ]
        s = Structure(
            layer=call.path if call is not None else "",
            call=call,
            input_node=q_node,
            roles=roles,
            shared={},
            out=out,
            unused=unused,
            heads=heads,
            kv_heads=heads,
            head_dim=e // heads,
            cores=[Core(q_node, k_node, v_node, e // heads, fused=op)],
        )
        if a.get("bias_k") is not None or a.get("bias_v") is not None:
            raise Unsupported(
                "not supported yet: learned bias key/value rows appended to every sequence's "
                f"keys and values (add_bias_kv) at {op.location}"
            )
        if a.get("add_zero_attn"):
            raise Unsupported(
                "not supported yet: a zero key/value row appended to every sequence's keys and "
                f"values (add_zero_attn) at {op.location}"
            )
        if a.get("is_causal"):
            s.causal = f"is_causal=True at {op.location}"
        mask = a.get("attn_mask")
        if mask is not None:
            shape = mask_shape(mask.bool() if mask.dtype == torch.bool else mask <= -1e4)
            if shape is not None and shape[0] in ("causal", "anti-causal"):
                s.causal = f"a {shape[0]} attn_mask at {op.location}"
        q_roots = self.g.roots(q_node)
        if any(self.g.roots(n) - q_roots for n in (k_node, v_node)):
            s.cross = op.location  # keys and values from another sequence
        # one tensor for the keys and values (and the queries, in self-attention): what
        # DETR adds to the queries and keys alone (a position embedding) is not modelled
        given = [self.ops[n].output for n in (q_node, k_node, v_node)]
        if not _same(given[1], given[2]) or (s.cross is None and not _same(given[0], given[1])):
            which = "keys and values" if s.cross is not None else "queries, keys and values"
            raise Unsupported(
                f"not supported yet: {which} given different tensors (a position embedding "
                f"added to some of them only, as DETR adds it?) at {op.location}"
            )
        return s


def _same(a: T, b: T) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b))


# ------------------------------------------------------------------------------ features


_SOFTMAX_LIKE = {"softmax", "_softmax", "log_softmax", "exp", "exp2", "sigmoid", "softmax_"}


def stage_of(rec: Recorder, st: Structure, index: int):
    """The stage a recorded op belongs to, by where it sits between the core's products:
    a projection's path, the scores, the steps to the weights, the context, the output."""
    from ..stages import Stage

    g = Graph(rec)
    ops = rec.ops
    descendants = g.descendants

    def ancestors(node: int) -> set[int]:
        return g.ancestors(node, every=True)

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
        return Stage.MASKED_SCORES if steps & MASKING_OPS and st.causal else Stage.SCALED_SCORES
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
    if not line.isdigit():
        return False
    # an einsum may name its operands queries first and write the keys' axis first in its
    # output (``"bhqd,bhkd->bhkq"``): keys times queries all the same
    flipped = op.name == "einsum" and _einsum_flipped(op.call_args)
    traced = _operand_roles(path, int(line))
    if traced is not None:
        return traced == (["q", "k"] if flipped else ["k", "q"])
    text = _statement(path, int(line))
    text = re.sub(r"^\s*[\w.,\[\]\s]+?=(?!=)", "", text)  # an assignment's target
    if flipped:  # the equation's own letters are no operand names
        text = re.sub(r"""(['"])[^'"]*->[^'"]*\1""", "", text)
    words = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)
    roles = [role_hint(w) for w in words if role_hint(w) in ("q", "k")]
    return roles[:2] == (["q", "k"] if flipped else ["k", "q"])


def _einsum_flipped(call_args: tuple) -> bool:
    """Whether an einsum of two operands writes, in its output, the axis only the second
    has before the axis only the first has (``"bhqd,bhkd->bhkq"``: the second's tokens
    first, so the product is the second times the first)."""
    eq = call_args[0] if call_args and isinstance(call_args[0], str) else None
    if eq is None or "->" not in eq:
        return False
    ins, out = eq.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return False
    first = [c for c in parts[0] if c.isalpha() and c not in parts[1]]
    second = [c for c in parts[1] if c.isalpha() and c not in parts[0]]
    if len(first) != 1 or len(second) != 1 or first[0] not in out or second[0] not in out:
        return False
    return out.index(second[0]) < out.index(first[0])


#: a product's two operands, by position and by keyword: (positions, keywords)
_OPERANDS = {
    "baddbmm": ((1, 2), ("batch1", "batch2")),
    "addmm": ((1, 2), ("mat1", "mat2")),
    "matmul": ((0, 1), ("input", "other")),
    "bmm": ((0, 1), ("input", "mat2")),
    "mm": ((0, 1), ("input", "mat2")),
}


def _operand_roles(path: str, line: int) -> list[str] | None:
    """The roles (q, k) the two operands of the product on ``line`` are made from, read in
    the code: an operand named by a local variable is read where that variable was last
    assigned before (``q, k = key.reshape(...), query.mT``: q holds the keys), so that a
    name reused for another tensor does not decide. None where the code does not say."""
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None
    funcs = [
        f
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        and f.lineno <= line <= (f.end_lineno or f.lineno)
    ]
    if not funcs:
        return None
    fn = max(funcs, key=lambda f: f.lineno)
    operands = None
    for node in ast.walk(fn):
        if getattr(node, "lineno", None) != line:
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if name not in _OPERANDS:
                continue
            (i, j), names = _OPERANDS[name]
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                given = list(node.args)
            else:  # a method: ``a.matmul(b)``
                given = [node.func.value, *node.args]
                if name in ("baddbmm", "addmm"):
                    continue
            keywords = {k.arg: k.value for k in node.keywords}
            operands = [
                given[i] if i < len(given) else keywords.get(names[0]),
                given[j] if j < len(given) else keywords.get(names[1]),
            ]
        if operands is not None:
            break
    if operands is None or None in operands:
        return None
    roles = [_expr_role(e, fn, line, 4) for e in operands]
    return roles if None not in roles else None


def _expr_role(expr, fn, line: int, depth: int) -> str | None:
    """The first role (q or k) the words of ``expr`` name, a local variable read where it
    was last assigned before ``line`` in ``fn``."""
    for node in sorted(
        (n for n in ast.walk(expr) if isinstance(n, ast.Name | ast.Attribute)),
        key=lambda n: (n.lineno, n.col_offset),
    ):
        word = node.id if isinstance(node, ast.Name) else node.attr
        role = role_hint(word)
        if role not in ("q", "k"):
            continue
        if isinstance(node, ast.Name) and depth > 0:
            source = _assigned(fn, node.id, line)
            if source is not None:
                deeper = _expr_role(source[0], fn, source[1], depth - 1)
                if deeper is not None:
                    return deeper
        return role
    return None


def _assigned(fn, name: str, line: int):
    """What ``name`` was last assigned in ``fn`` before ``line`` (the matching element of a
    tuple assignment), with that assignment's line; None where it is not read plainly."""
    last = None
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign) or node.lineno >= line:
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id == name:
                found = (node.value, node.lineno)
            elif (
                isinstance(target, ast.Tuple)
                and isinstance(node.value, ast.Tuple)
                and len(target.elts) == len(node.value.elts)
            ):
                found = next(
                    (
                        (v, node.lineno)
                        for t, v in zip(target.elts, node.value.elts, strict=True)
                        if isinstance(t, ast.Name) and t.id == name
                    ),
                    None,
                )
            elif isinstance(target, ast.Tuple) and any(
                isinstance(t, ast.Name) and t.id == name for t in target.elts
            ):
                found = ("unread", node.lineno)
            else:
                continue
            if found is not None and (last is None or found[1] > last[1]):
                last = found
    if last is None or last[0] == "unread":
        return None
    return last


def projection_input(rec: Recorder, st: Structure, like: T) -> T | None:
    """In another call's record, what the query projection read, laid out as ``like``
    ``(batch, tokens, d)``: the reference input of a layer that transforms its input first."""
    q = st.roles["q"][0]
    g = Graph(rec)
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


_ROLE_WORDS = {
    "q": {"q", "query", "queries", "wq"},
    "k": {"k", "key", "keys", "wk"},
    "v": {"v", "value", "values", "wv"},
    "o": {"o", "out", "output", "wo"},
}


def _keys_first(roles: dict, shared: dict, widths: dict) -> bool:
    """Whether the scores' first operand is the keys: separate projections where the first
    operand's is narrower than the second's and as wide as the values' (grouped heads: the
    wider side has more heads, and only queries have more heads than values)."""
    if shared or not all(roles[r] for r in ("q", "k", "v")):
        return False
    q, k, v = widths.get("q", 0), widths.get("k", 0), widths.get("v", 0)
    return 0 < q < k and q == v and k % q == 0


def _per_sequence_once(projs: list[Projection]) -> list[Projection]:
    """One role's projections, each weight once where it is applied to the sequences of the
    batch one by one (picoGPT's loop over the batch): applied to each sequence's slice of
    one input, it is one projection (the first sequence's stands for it)."""
    if len(projs) < 2 or not all(p.params for p in projs):
        return projs
    kept: list[Projection] = []
    for p in projs:
        if not any(o.params == p.params and _same_weight(o, p) for o in kept):
            kept.append(p)
    return kept


def _same_weight(a: Projection, b: Projection) -> bool:
    """The same weight and bias, value for value (not two slices of one parameter)."""
    if a.w.shape != b.w.shape or not torch.equal(a.w, b.w):
        return False
    return (a.b is None) == (b.b is None) and (a.b is None or torch.equal(a.b, b.b))


def role_hint(name: str) -> str | None:
    """The role a parameter's name suggests (q, k, v, o): a tie-break, never a verdict."""
    parts = name.lower().split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias", "kernel"):
        parts = parts[:-1]
    words = set(re.split(r"[_\W]+", parts[-1]))
    found = [role for role, w in _ROLE_WORDS.items() if words & w]
    return found[0] if len(found) == 1 else None
