"""What the layer's computation does on the way to and from the scores beyond textbook
attention: a causal mask (the evidence for the kind), and the features the checker does not
model yet (rotary positions, QK norm, grouped key/value heads, position biases, sliding
windows, cross-attention), refused with the line that shows them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import AttnScopeError
from .dataflow import LAYOUT_OPS
from .projections import constant_factor
from .record import Op

if TYPE_CHECKING:
    from .dataflow import Graph
    from .layer import Core, Structure

__all__ = ["Unsupported", "Features", "BiasSeen", "mask_shape", "MASKING_OPS"]

#: the attention computations read for features, at most: a layer that loops over its
#: tokens and heads (gemma.cpp's) makes one per token and head, all alike; those spread
#: over the record stand for them (reading each made a layer take minutes)
_CORES_READ = 48


def _spread(items: list, most: int) -> list:
    """``items``, or ``most`` of them spread evenly from the first to the last."""
    if len(items) <= most:
        return items
    step = (len(items) - 1) / (most - 1)
    return [items[round(i * step)] for i in range(most)]


T = torch.Tensor

#: entries at or below this hide their cells (a mask's finfo.min, -1e9, -1e4), not values
HIDDEN = -1e4


def hides(t: T) -> T:
    """Where an additive mask or bias hides its cells: not finite, or at most :data:`HIDDEN`."""
    return ~torch.isfinite(t) | (t <= HIDDEN)


def bias_like(t: T) -> bool:
    """Whether an additive tensor holds more than two values where it does not hide: a
    position bias (or a bias made from the input), not a mask of 0 and a fill."""
    t = t.detach().double()
    return torch.unique(t[~hides(t)]).numel() > 2


#: ops that rank their input: a selection by them is top-k sparse attention
_RANKING = {"topk", "sort", "argsort", "kthvalue", "msort"}
#: ops that pick entries of a tensor at given indices
_GATHERS = {"gather", "index_select", "take_along_dim", "__getitem__", "index"}
_SCALAR_OPS = {"mul", "__mul__", "__rmul__", "div", "__truediv__", "__rtruediv__", "mul_", "div_"}
_SHIFT_OPS = {"add", "__add__", "__radd__", "add_", "sub", "__sub__", "__rsub__", "sub_"}
_ROTARY_CALLS = {"view_as_complex", "view_as_real", "polar", "complex"}
#: norms that make a vector unit length (F.normalize, x / x.norm()): cosine attention
_UNIT_NORMS = {"normalize", "norm", "vector_norm", "linalg_vector_norm"}
#: a norm on the path to the scores (an RMSNorm written as x / sqrt(mean(x²) + eps) too)
_NORM_CALLS = {"layer_norm", "rms_norm", "group_norm", "rsqrt", "sqrt", "normalize", "norm"}
_NORM_CALLS |= {"vector_norm"}
MASKING_OPS = {"masked_fill", "masked_fill_", "where", "add", "__add__", "__radd__", "add_", "sub"}
MASKING_OPS |= {"__sub__", "sub_", "__iadd__", "__isub__"}
MASKING_OPS |= {"mul", "__mul__", "__rmul__", "mul_", "tril", "triu", "tril_", "triu_"}
#: terms added to (or taken from) the scores
_ADDS = {"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__", "sub_"}
_ADDS |= {"__isub__"}


#: normalisations (a call, or a norm written out): on the context before the output
#: projection, a step the reference does not have (heads averaged is a mean alone)
_NORMS = _NORM_CALLS | {"var", "std", "var_mean"}
#: matrix products
MATMULS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum"}
#: convolutions (over the tokens, where wider than one)
_CONVS = {"conv1d", "conv2d", "conv3d"}
#: pooling over the tokens (or a grid of them)
_POOLS = {
    f"{kind}_pool{n}d" for kind in ("avg", "max", "adaptive_avg", "adaptive_max") for n in (1, 2, 3)
}
_POOLS |= {"interpolate"}
#: elementwise products that gate a tensor
_GATES = {"mul", "__mul__", "__rmul__", "mul_", "multiply"}
#: calls that write into a tensor in place (a KV cache's update)
_WRITES = {"__setitem__", "index_put_", "index_copy_", "copy_", "scatter_", "index_add_"}


_SOFTMAX_CALLS = {"softmax", "_softmax", "softmax_", "log_softmax", "exp", "exp2"}
_SCORE_MIXING = {
    "conv1d",
    "conv2d",
    "conv3d",
    "linear",
    "matmul",
    "__matmul__",
    "einsum",
    "bmm",
    "mm",
    "tensordot",
}
_COMBINE = {"add", "__add__", "__radd__", "add_", "sub", "__sub__", "__rsub__", "sub_", "rsub"}


class Unsupported(AttnScopeError):
    """The layer holds something the checker does not model yet: no verdict is given."""


def seen_keys(g: Graph, core: Core) -> T | None:
    """Which keys some query sees: a weight above zero after the softmax, in any row of any
    head or sequence (``(keys,)`` bool); None where the weights are not read (a fused
    call). The rest are slots no query sees: a static cache's unwritten slots."""
    if core.score is None:
        return None
    after = g.descendants(core.score.index)
    soft = next((g.ops[i] for i in sorted(after) if g.ops[i].name in _SOFTMAX_CALLS), None)
    w = soft.output if soft is not None else None
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        return None
    return w.detach().abs().reshape(-1, w.shape[-1]).amax(0) > 0


def mask_shape(hidden: T) -> tuple[str, int] | None:
    """What a hidden-cells pattern is, on its last two axes: ``("causal", d)`` when it hides
    keys ``j - i >= d``, ``("anti-causal", d)`` when it hides ``j - i <= d``, ``("window",
    w)`` for a causal band ``w`` keys wide (the query included), ``("band", h)`` for keys
    within ``h`` positions on either side (bidirectional local attention), or None."""
    if hidden.dim() < 2:
        return None
    h = hidden.reshape(-1, *hidden.shape[-2:])[0]
    n, m = h.shape
    if n != m or n < 2 or not bool(h.any()) or bool(h.all()):
        return None  # nothing hidden (a zero bias) or everything: no mask
    ones = torch.ones(n, n, dtype=torch.bool)
    for d in range(-n + 1, n + 1):
        if torch.equal(h, ones.triu(d)):
            return ("causal", d)
        if torch.equal(h, ones.tril(d)):
            return ("anti-causal", d)
    for w in range(1, n):
        if torch.equal(h, ones.triu(1) | ones.tril(-w)):
            return ("window", w)
    if n > 2 and torch.equal(h, ones.triu(2) | ones.tril(-2)):
        return ("band", 1)  # the query and one key on either side, before the reading below
    for w in range(1, n):
        for d in (0, 2):  # a window whose diagonal is off: the window all the same (a mistake)
            if torch.equal(h, ones.triu(d) | ones.tril(-w)):
                return ("window", w)
    for half in range(1, n - 1):  # keys within `half` positions on either side (local)
        if torch.equal(h, ones.triu(half + 1) | ones.tril(-half - 1)):
            return ("band", half)
        # one edge a key short (an off-by-one in tril/triu's diagonal): the band all the
        # same, by its wider side (a mistake the comparison with the reference names)
        for behind, ahead in ((half, half - 1), (half - 1, half)) if half > 1 else ():
            if torch.equal(h, ones.triu(ahead + 1) | ones.tril(-behind - 1)):
                return ("band", half)
    return None


def tokens_last(hidden: T) -> T:
    """A mask laid out tokens first, ``[T_q, T_k, ...]`` (sequence-first layers' scores
    ``[i, j, batch, heads]``), or with its query axis apart from the keys' by axes of one,
    with its two token axes moved last; any other as it is."""
    if hidden.dim() < 3 or hidden.shape[-1] == hidden.shape[-2] > 1:
        return hidden
    if hidden.shape[0] != hidden.shape[1] or hidden.shape[0] < 2:
        # queries before the heads, keys last (penzai's ``[b, s, kv_heads, q_rep, t]``): a
        # mask broadcast over the heads has its query axis apart from the keys' by ones
        n = hidden.shape[-1]
        for i in range(hidden.dim() - 3, -1, -1):
            between = hidden.shape[i + 1 : -1]
            if hidden.shape[i] == n > 1 and all(d == 1 for d in between):
                return hidden.movedim(i, -2)
        return hidden
    return hidden.movedim((0, 1), (-2, -1))


def _lower_triangle_kept(t: T) -> T | None:
    """Where a mask of two finite values (a boolean tril or band cast to floats and added:
    1 where a key is seen, 0 where hidden) gives the lower one, when those cells are the
    keys after each query, or those outside a sliding window or a local band: a mask
    filled with the wrong value (the judge names it); None otherwise."""
    if t.dim() < 2 or t.shape[-1] != t.shape[-2] or t.shape[-1] < 2:
        return None
    values = torch.unique(t)
    if values.numel() != 2:
        return None
    low = t == values[0]
    n = t.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    if bool((low == future).all()):
        return low
    flat = low.reshape(-1, n, n)
    if not bool((flat == flat[:1]).all()):
        return None
    shape = mask_shape(flat[0])
    return low if shape is not None and shape[0] in ("window", "band") else None


def _causal_slice(hidden: T) -> bool:
    """Whether a mask ``(..., T_q, K)`` hides, in every batch and head alike, exactly the
    keys after each query of a run of keys starting at some offset: the causal mask's
    piece for one slice of the keys (split-KV attention merges such pieces)."""
    if hidden.dim() < 2:
        return False
    q, k = hidden.shape[-2:]
    rows = hidden.reshape(-1, q, k)
    if not bool((rows == rows[:1]).all()):
        return False
    one = rows[0]
    i, j = torch.arange(q)[:, None], torch.arange(k)[None, :]
    return any(torch.equal(one, j + off > i) for off in range(max(q, 1)))


def causal_chunks(hidden: T) -> int | None:
    """The chunk size ``c`` of a causal mask within chunks (Llama 4's chunked attention:
    query ``i`` sees key ``j`` where ``j <= i`` and ``i // c == j // c``), or None."""
    if hidden.dim() < 2 or hidden.shape[-1] != hidden.shape[-2] or hidden.shape[-1] < 3:
        return None
    h = hidden.reshape(-1, *hidden.shape[-2:])[0].bool()
    n = h.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    pos = torch.arange(n)
    for c in range(2, n):
        chunk = pos // c
        if torch.equal(h, causal | (chunk[:, None] != chunk[None, :])):
            return c
    return None


def _other_pattern(hidden: T) -> bool:
    """A token x token mask that hides some keys and not others, the same in every batch
    and head (a designed pattern, not padding), of no shape :func:`mask_shape` reads."""
    if hidden.dim() < 2 or hidden.shape[-1] != hidden.shape[-2] or hidden.shape[-1] < 3:
        return False
    flat = hidden.reshape(-1, *hidden.shape[-2:]).bool()
    if not bool((flat == flat[:1]).all()):
        return False
    h = flat[0]
    return bool(h.any()) and not bool(h.all()) and not bool(h.all(-1).any())


def _packed_batch(hidden: T, lead: tuple[int, int] | None) -> bool:
    """A mask that hides exactly the cells between the sequences of a batch packed into
    one sequence (xformers' ``BlockDiagonalMask``): for an input of ``lead`` (batch,
    tokens), queries along all the batch's tokens and one diagonal block per sequence."""
    if lead is None or lead[0] < 2 or hidden.dim() < 2:
        return False
    batch, tokens = lead
    flat = hidden.reshape(-1, *hidden.shape[-2:]).bool()
    n, m = flat.shape[-2:]
    if n != batch * tokens or m % batch or not bool((flat == flat[:1]).all()):
        return False  # not the whole batch's queries in one row of scores
    seq_q = torch.arange(n) // (n // batch)
    seq_k = torch.arange(m) // (m // batch)
    return torch.equal(flat[0], seq_q[:, None] != seq_k[None, :])


def _packed_rows(hidden: T, lead: tuple[int, int] | None, chunk: int) -> bool:
    """Whether a mask causal within chunks of ``chunk`` tokens runs along all the tokens
    of a batch of ``lead`` (batch, tokens), one chunk per sequence: the sequences packed
    into one."""
    if lead is None or lead[0] < 2 or chunk != lead[1]:
        return False
    return hidden.shape[-1] == hidden.shape[-2] == lead[0] * lead[1]


def _packed_leak(hidden: T, lead: tuple[int, int] | None) -> T | None:
    """The cells a mask hides where a batch of ``lead`` (batch, tokens) is packed into one
    sequence (queries and keys along all the batch's tokens, alike in every head) and some
    query sees a key of another sequence (sequence ids made wrongly: ``% batch`` for
    ``// tokens``), each query seeing at least one key; None otherwise."""
    if lead is None or lead[0] < 2 or hidden.dim() < 2:
        return None
    batch, tokens = lead
    flat = hidden.reshape(-1, *hidden.shape[-2:]).bool()
    n, m = flat.shape[-2:]
    if n != batch * tokens or m != n or not bool((flat == flat[:1]).all()):
        return None
    seq = torch.arange(n) // tokens
    other = seq[:, None] != seq[None, :]
    h = flat[0]
    if bool(h.all(-1).any()) or not bool((other & ~h).any()):
        return None
    return h.clone()


@dataclass
class BiasSeen:
    """A position bias added to the scores: its tensor as recorded, the shape of the scores
    it was added to, its line, and whether the scale comes after it (Falcon's order)."""

    tensor: T
    scores_shape: tuple[int, ...]
    location: str | None
    before_scale: bool = False
    #: made from the layer's trainable parameters (a learned bias: T5's buckets), not from
    #: constants (ALiBi's slopes)
    learned: bool = False


def _per_position(t: torch.Tensor, tokens: int | None) -> bool:
    """A factor broadcast over the features (its last axis one) that differs along an axis
    as long as the sequence (the probe's length is unlike every other size): a temperature
    by position (``scales[None, None, :, None]``); not a rotation's tables (as many entries
    as features), a norm's gain (along the features), nor a temperature per head."""
    if tokens is None or tokens < 2 or t.dim() < 2 or t.shape[-1] != 1:
        return False

    def alike_along(ax: int) -> bool:
        return bool((t == t.narrow(ax, 0, 1)).all())

    # varying along the tokens alone (tinygrad's cos/sin pairs, ``(1, T, 1, d/2, 1)``,
    # vary along the features' pairs too: a rotation)
    return any(
        size == tokens
        and not alike_along(ax)
        and all(alike_along(other) for other in range(t.dim()) if other != ax)
        for ax, size in enumerate(t.shape[:-1])
    )


class Features:
    """Causal masks and the features not modelled yet, each found on its path."""

    def __init__(self, g: Graph, s: Structure):
        self.s, self.g, self.ops = s, g, g.ops
        self.window_seen = 0  # the window of the last band-shaped mask judged
        self._bias_seen: T | None = None
        self._learned = False  # the bias seen is made from trainable parameters
        #: the axis the scores' softmax normalises, from the end, on the path judged
        self._keys_axis: int | None = None
        #: how the last mask judged was applied, where it hid some scores in a layout no
        #: reading placed (see _judge_hidden)
        self._unread: str | None = None
        self._softmaxes = {o.index for o in self.ops if o.name in _SOFTMAX_CALLS}

    def _lead(self) -> tuple[int, int] | None:
        """The probe's (batch, tokens): the leading axes of the first input."""
        first = next((op for op in self.ops if op.leaf == "input:0"), None)
        if first is None or first.output.dim() != 3:
            return None
        return tuple(first.output.shape[:2])

    def find(self) -> None:
        s = self.s
        self._cross()
        self._one_role_shifted()
        self._pooled_kv()
        self._rotated_input()
        cores = _spread(s.cores, _CORES_READ)
        for core in cores:
            self._cached(core)
        for core in cores:
            for role, node in (("queries", core.q_node), ("keys", core.k_node)):
                self._qk_path(role, node)
            self._joined_rows(core)
            self._tokens_projected(core)
            self._score_path(core)
            self._gated(core)
            self._convolved(core)
        self._multiplied_softmaxes()
        for core in cores:  # after the rest: what they name of a selection comes first
            self._selected(core)

    def _cached(self, core: Core) -> None:
        """Keys or values written in place into a tensor not made from the input (a buffer,
        a preallocated cache) and the scores then taken over more keys than the sequence
        has: a KV cache the forward requires, read back whole (what a refusal names: the
        rest of the layer is then read for keys that are not the sequence's)."""
        if self.s.cross is not None:
            return
        if core.fused is not None:
            q, k = self.ops[core.q_node].output, self.ops[core.k_node].output
            shape = (q.shape[-2], k.shape[-2]) if min(q.dim(), k.dim()) >= 2 else None
        else:
            out = core.score.output if core.score is not None else None
            shape = tuple(out.shape[-2:]) if out is not None and out.dim() >= 2 else None
        if shape is None or shape[0] == shape[1]:
            return
        single = len(self.s.cores) == 1
        if shape[1] < shape[0] and single and self._weighs(core) in (None, shape[1]):
            # fewer keys than queries, from the sequence itself, in the one product there
            # is (not a block of keys beside others, split-KV's), the weights over no more
            # (not one block whose scores are joined to the others' before the softmax):
            # keys and values cut to some of its tokens (TabPFN's training items)
            op = core.fused or core.score
            self._unmodelled(
                f"keys and values for {shape[1]} of the sequence's {shape[0]} tokens only (a "
                "part of the sequence every query attends to, as TabPFN's training items?)",
                op.location if op is not None else None,
            )
            return
        for node in (core.k_node, core.v_node):
            for i in sorted(self.g.ancestors(node)) if node is not None else []:
                op = self.ops[i]
                if op.name not in _WRITES or not op.args or self.g.tainted[op.args[0]]:
                    continue
                if any(self.g.tainted[a] for a in op.args[1:]) and self.s.cache is None:
                    self.s.cache = (
                        "a KV cache its forward requires (keys and values written into a "
                        f"tensor not made from the input, and the scores read {shape[1]} keys "
                        f"for {shape[0]} queries{self._hidden_slots(core, shape)}; no "
                        "rotation and norm read on the slots some query sees explain them)",
                        op.location,
                    )

    def _weighs(self, core: Core) -> int | None:
        """How many keys the weights the context is made from weigh (their last axis), or
        None where no context product is seen."""
        ctx = core.context
        if ctx is None or not ctx.args:
            return None
        w = self.ops[ctx.args[0]].output
        return int(w.shape[-1]) if isinstance(w, torch.Tensor) and w.dim() >= 2 else None

    def _hidden_slots(self, core: Core, shape: tuple[int, int]) -> str:
        """How many of the keys read no query sees (slots of a static cache not written,
        hidden by the mask: see :func:`seen_keys`), as a clause; empty where the weights
        are not read (a fused call) or every key is seen."""
        seen = seen_keys(self.g, core)
        if seen is None or seen.numel() != shape[1] or bool(seen.all()):
            return ""
        hidden = int((~seen).sum())
        return (
            f": {shape[1] - hidden} it attends to and {hidden} slots that no query "
            "sees (weight 0: unwritten slots of a static cache, hidden by the mask)"
        )

    def _one_role_shifted(self) -> None:
        """One projection reading another's input plus a tensor not made from the input (a
        position embedding added to the queries' and keys' input only, as DETR adds it):
        the reference projects every role from the one input, so this is not modelled."""
        inputs = {role: {p.input_node for p in ps} for role, ps in self.s.roles.items() if ps}
        nodes = set().union(*inputs.values()) if inputs else set()
        for node in nodes:
            op = self.ops[node]
            if op.name not in ("add", "__add__", "__radd__", "add_") or len(op.args) != 2:
                continue
            mine = [a for a in op.args if a in nodes and a != node]
            added = [a for a in op.args if not self.g.tainted[a]]
            if mine and added and self.ops[added[0]].output.numel() > 1:
                what = "a learned tensor" if self.g.param[added[0]] else "a constant tensor"
                self._refuse(
                    f"{what} added to the input of some projections only (a position "
                    "embedding for the queries and keys, not the values, as DETR adds it?)",
                    op.location,
                )

    def _own(self, role: str, against: str) -> set[int]:
        """The ops (inside the layer) that make the input of ``role``'s projections and not
        the input of ``against``'s."""
        start = self.s.call.start if self.s.call is not None else 0

        def made(r: str) -> set[int]:
            return set().union(*(self.g.ancestors(p.input_node) for p in self.s.roles[r]))

        if not self.s.roles[role] or not self.s.roles[against]:
            return set()
        return {i for i in made(role) - made(against) if i >= start and self.ops[i].leaf is None}

    def _pooled_kv(self) -> None:
        """Keys and values read from the input pooled over its tokens (PVTv2-Li's adaptive
        average pool of the token grid: a fixed number of pooled keys): the reference reads
        one key per token."""
        for role in ("k", "v"):
            for i in sorted(self._own(role, "q")):
                op = self.ops[i]
                if op.name in _POOLS and op.args and self.g.tainted[op.args[0]]:
                    self._refuse(
                        f"keys and values read from the input pooled over the tokens "
                        f"({op.name}: a spatial reduction, as PVTv2-Li's, that downsamples the "
                        "sequence the keys and values are projected from)",
                        op.location,
                    )

    def _rotated_input(self) -> None:
        """The queries' and keys' projections reading the layer's input rotated (cos/sin
        tables and a rotate-half, as Wav2Vec2-Conformer applies rotary to its input), the
        values' the input as it is: a rotation before the projections, which the reference
        (rotary on the projected queries and keys) does not model."""
        own = self._own("q", "v")
        ops = [self.ops[i] for i in sorted(own)]
        rotates = any(o.name in ("cat", "neg", "__neg__", "stack", "flip") for o in ops)
        for op in ops:
            if op.name not in _GATES or not rotates:
                continue
            consts = [a for a in op.args if not self.g.tainted[a] and not self.g.param[a]]
            tables = [self.ops[a].output for a in consts]
            if any(t.numel() > 1 and not bool((t == t.flatten()[0]).all()) for t in tables):
                self._refuse(
                    "a rotation applied to the layer's input before the query and key "
                    "projections (rotary position embedding on the inputs, as "
                    "Wav2Vec2-Conformer's, not on the projected queries and keys)",
                    op.location,
                )

    def _tokens_projected(self, core: Core) -> None:
        """Keys or values multiplied, after their projection, by a weight along the tokens
        axis (Linformer's ``einsum("bnd,nk->bkd")``: the sequence projected to a fixed number
        of rows): a projection over the tokens, which the reference does not have."""
        lead = self._lead()
        if lead is None or self.s.cross is not None:
            return
        n = lead[1]
        start = self.s.call.start if self.s.call is not None else 0
        for p in self.s.roles["k"] + self.s.roles["v"]:
            # read as the projection itself: a weight with a tokens-long axis, applied to
            # what another weight made from the input
            before = [
                self.ops[i]
                for i in self.g.ancestors(p.input_node)
                if i >= start and self.ops[i].leaf is None and i != p.op.index
            ]
            made = any(any(self.g.param[a] for a in o.args) for o in before)
            w = getattr(p, "w", None)
            if made and isinstance(w, T) and w.dim() >= 2 and n in w.shape and p.op.name in MATMULS:
                self._refuse(
                    "keys and values projected along the tokens axis to a fixed number "
                    "of rows (a projection over the tokens, Linformer's low-rank step)",
                    p.op.location,
                )
        stops = {p.op.index for ps in self.s.roles.values() for p in ps}
        for node in (core.k_node, core.v_node):
            if node is None:
                continue
            for op in self._path(node, stops):
                if op.name not in MATMULS:
                    continue
                weights = [self.ops[a].output for a in op.args if self.g.param[a]]
                if any(t.dim() >= 2 and n in t.shape for t in weights):
                    self._refuse(
                        "keys and values projected along the tokens axis to a fixed number "
                        "of rows (a projection over the tokens, Linformer's low-rank step)",
                        op.location,
                    )

    def _selected(self, core: Core) -> None:
        """Keys, values or scores chosen by ranking something made from the input (``topk``,
        a sort): sparse attention that keeps the k most relevant keys (FlashVDM's key
        selection, top-k sparse weights), which the reference does not model."""
        end = core.context if core.context is not None else core.fused
        if end is None:
            return
        before = self.g.ancestors(end.index)
        kv = set()  # what the keys and values the core reads are made from
        for node in (core.k_node, core.v_node):
            if node is not None:
                kv |= self.g.ancestors(node)
        for i in sorted(before):
            op = self.ops[i]
            if op.name in _RANKING and any(self.g.tainted[a] for a in op.args):
                what = (
                    f"a selection by {op.name} of what the input makes (top-k sparse "
                    "attention: only the most relevant keys or scores kept)"
                )
                if i in kv or self._gathers_by(i, before | {end.index}):
                    self._refuse(what, op.location)  # the keys or values themselves chosen
                self._unmodelled(what, op.location)
                return

    def _gathers_by(self, rank: int, within: set[int]) -> bool:
        """Whether an op among ``within`` picks rows of a tensor made from the input (the
        keys, the values) at indices the ranking op ``rank`` made (FlashVDM's
        ``gather(key, -2, topk(...).indices)``)."""
        for i in sorted(within):
            op = self.ops[i]
            if op.name not in _GATHERS or len(op.args) < 2 or i <= rank:
                continue
            data, picks = op.args[0], op.args[1:]
            made_by_rank = rank in self.g.ancestors(data) or data == rank
            by_rank = any(a == rank or rank in self.g.ancestors(a) for a in picks)
            if self.g.tainted[data] and not made_by_rank and by_rank:
                return True
        return False

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
                roots = self.g.roots(p.input_node)
                if q and roots != q:
                    if not (roots - q):
                        continue  # a mix of the queries' own input: not another sequence
                    if roots & q:  # the queries' input and another sequence, together
                        self._unmodelled(
                            f"the {'keys' if role == 'k' else 'values'} made from the input "
                            "joined to another sequence (a memory or prefix beside the "
                            "tokens, Transformer-XL's)",
                            p.op.location,
                        )
                    s.cross = p.op.location  # keys and values from another sequence

    def _path(self, node: int, stops: set[int]) -> list[Op]:
        """The ops between the projections (or the layer's input) and a core operand."""
        start = self.s.call.start if self.s.call is not None else 0
        before = {op.index for op in self.ops[:start]}
        seen = self.g.ancestors(node, stop=stops | before)
        return [
            self.ops[i]
            for i in sorted(seen)
            if i not in stops and i >= start and self.ops[i].leaf is None
        ]

    def _tokens(self) -> int | None:
        """The length of the sequence the layer was called on (its input's tokens)."""
        node = self.s.input_node
        if node is None or self.ops[node].output.dim() < 2:
            return None
        return int(self.ops[node].output.shape[-2])

    def _qk_path(self, role: str, node: int) -> None:
        stops = self.s.projection_ops
        path = self._path(node, stops)
        normed = any(op.name in _NORM_CALLS for op in path)
        rotates = any(o.name in ("cat", "neg", "__neg__", "stack", "flip") for o in path)
        for op in path:
            name = op.name
            if name in ("clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_max"):
                # OLMo's clip_qkv: a range the projections are held to (not a position's)
                self._unmodelled(
                    f"the {role} clipped to a range on their way to the scores ({name}: "
                    "OLMo's clip_qkv?)",
                    op.location,
                )
                continue
            if name in _ROTARY_CALLS:
                self.s.rotary.setdefault(
                    role, ("rotary position embedding (complex rotation)", op.location)
                )
                continue
            if name in _NORM_CALLS:
                self.s.qk_norm.setdefault(
                    role, (f"a norm applied to the {role} (QK norm)", op.location)
                )
                if name in _UNIT_NORMS:
                    self._unmodelled(
                        f"cosine attention (the {role} normalised to unit length by {name}: "
                        "scores that are cosine similarities, scaled by a factor of their "
                        "own?)",
                        op.location,
                    )
                continue
            if name in LAYOUT_OPS or name not in (_SCALAR_OPS | {"add", "__add__", "sub"}):
                continue
            moved = [a for a in op.args if self.g.tainted[a]]
            factor = constant_factor(self.g, op, moved[0]) if len(moved) == 1 else None
            if factor is not None:  # one number for every entry: a multiplier, not a position
                self.s.qk_factors[op.index] = (role, factor, op.location)
                continue
            consts = [self.ops[a].output for a in op.args if not self.g.tainted[a]]
            varying = [t for t in consts if t.numel() > 1 and not bool((t == t.flatten()[0]).all())]
            if name in _SCALAR_OPS and any(_per_position(t, self._tokens()) for t in varying):
                self._unmodelled(
                    f"a factor on the {role} that changes with the position, the same for every "
                    "feature (a position-dependent temperature, Llama 4's "
                    "attn_temperature_tuning, or log-n scaling?)",
                    op.location,
                )
                continue
            if varying:
                if normed and not rotates:
                    continue  # the norm's gain: read with the norm
                what = (
                    "rotary position embedding (cos/sin tables)"
                    if rotates
                    else f"a position- or feature-dependent factor on the {role}"
                )
                self.s.rotary.setdefault(role, (what, op.location))

    def _queries_added(self, op: Op, made: set[int]) -> bool:
        """Whether ``op`` adds to the context a tensor made from the queries' projection
        and not from any core's product."""
        q_ops = {p.op.index for p in self.s.roles.get("q", [])}
        products = {
            o.index for c in self.s.cores for o in (c.score, c.context, c.fused) if o is not None
        }
        for a in op.args:
            if a in made or not self.g.tainted[a]:
                continue
            before = self.g.ancestors(a)
            if before & q_ops and not before & products:
                return True
        return False

    def _gated(self, core: Core) -> None:
        """The context multiplied, before the layer's output, by another function of the
        input (AlphaFold's and Qwen3-Next's output gate, ``sigmoid(W_g x) * context``):
        a learned gate the reference does not model (a fixed or learned scale, a
        LayerScale, is no function of the input and is not one)."""
        start = core.context if core.context is not None else core.fused
        if start is None:
            return
        end = self.s.call.end if self.s.call is not None else len(self.ops)
        if self.s.out is not None:
            end = min(end, self.s.out.op.index)
        made = self.g.descendants(start.index)
        for op in self.ops[start.index + 1 : end]:
            if op.index in made and op.name in _NORMS and self.s.out is not None:
                # a sub-LayerNorm (Kosmos-2, Magneto, BitNet): not modelled unless the probe
                # reads it as a plain norm over the merged heads (and takes it off the list)
                what = (
                    f"a norm ({op.name}) applied to the context before the output projection "
                    "(a sub-LayerNorm inside the attention, as Kosmos-2 and Magneto have?)"
                )
                self.s.out_norm = (op.index, what, op.location)
                self._unmodelled(what, op.location)
                return
            if op.index in made and op.name in _ADDS and self._queries_added(op, made):
                self._unmodelled(
                    "the projected queries added to the context inside the attention (the "
                    "Set Transformer's O = Q + A V?)",
                    op.location,
                )
                return
            if op.index not in made or op.name not in _GATES:
                continue
            others = [a for a in op.args if a not in made and self.g.tainted[a]]
            others = [a for a in others if not self._from_scores_alone(a)]
            if any(self.ops[a].output.numel() > 1 for a in others):
                self._unmodelled(
                    "an output gate (the context multiplied by another function of the input, "
                    "sigmoid(W_g x) * context?)",
                    op.location,
                )
                return
            for a in op.args:
                t = self.ops[a].output.detach()
                if a in made or self.g.tainted[a] or t.numel() <= 1 or not t.is_floating_point():
                    continue
                if not bool((t.flatten() == t.flatten()[0]).all()):
                    self._unmodelled(
                        "a factor that varies by feature on the context before the output "
                        "projection (a LayerScale inside the layer?)",
                        op.location,
                    )
                    return

    def _from_scores_alone(self, node: int) -> bool:
        """Whether a tensor is made from the input only through attention scores: a
        softmax's bookkeeping (an online softmax's running rescale, the log-sum-exp
        weights that merge attention over parts of the keys), not a gate."""
        scores = {c.score.index for c in self.s.cores if c.score is not None}
        if not scores:
            return False
        seen = self.g.ancestors(node, stop=scores)
        if not seen & scores:
            return False
        made = set(self.s.projection_ops)
        if self.s.input_node is not None:
            made.add(self.s.input_node)
        return not any(
            i in made or (self.ops[i].leaf is not None and self.g.tainted[i]) for i in seen - scores
        )

    def _convolved(self, core: Core) -> None:
        """A convolution wider than one token inside the layer, before its output projection
        (Primer's depthwise ``Conv1d`` over the sequence after each projection;
        Nystromformer's over the values, added to the context): what it makes mixes
        several tokens, which nothing in the reference does but the weights."""
        s = self.s
        start = s.call.start if s.call is not None else 0
        end = s.call.end if s.call is not None else len(self.ops)
        if s.out is not None:
            end = min(end, s.out.op.index)
        for op in self.ops[start:end]:
            if op.name not in _CONVS or len(op.args) < 2 or not self.g.tainted[op.args[0]]:
                continue
            w = self.ops[op.args[1]].output
            if w.dim() >= 3 and any(k > 1 for k in w.shape[2:]):
                self._unmodelled(
                    f"a convolution over the tokens ({op.name}, kernel {tuple(w.shape[2:])}) "
                    "inside the attention (Primer's on the queries, keys and values; "
                    "Nystromformer's on the values, added to the context?)",
                    op.location,
                )
                return

    def _unmodelled(self, what: str, where: str | None) -> None:
        if not any(w == what for w, _ in self.s.unmodelled):
            self.s.unmodelled.append((what, where))

    def _joined_rows(self, core: Core) -> None:
        """Rows not made from the input joined to the keys or values (``nn.MultiheadAttention``
        with ``add_bias_kv``: a learned bias key and value; ``add_zero_attn``: zeros)."""
        stops = self.s.projection_ops
        for role, node in (("keys", core.k_node), ("values", core.v_node)):
            if node is None:
                continue
            for op in self._path(node, stops) + [self.ops[node]]:
                if op.name not in ("cat", "concat", "concatenate") or op.leaf is not None:
                    continue
                if not any(self.g.tainted[a] for a in op.args):
                    continue
                joined = [
                    a for a in op.args if not self.g.tainted[a] and self.ops[a].output.numel()
                ]
                if not joined:
                    continue
                learned = any(self.g.param[a] for a in joined)
                what = "learned bias key/value rows" if learned else "constant rows"
                self._unmodelled(
                    f"{what} joined to the {role} (nn.MultiheadAttention's add_bias_kv or "
                    "add_zero_attn: a bias key/value slot every query attends to)",
                    op.location,
                )

    def _varying_factor(self, op: Op, reach: set[int]) -> None:
        """A factor on the scores that differs by head or position and is no 0/1 mask (a
        learned per-head temperature, cosine attention's logit scale)."""
        if op.name not in ("mul", "__mul__", "__rmul__", "mul_", "div", "__truediv__", "div_"):
            return
        for a in op.args:
            if a in reach or self.g.tainted[a]:
                continue
            t = self.ops[a].output.detach()
            if t.numel() <= 1 or not t.is_floating_point():
                continue
            flat = t.flatten().double()
            if bool((flat == flat[0]).all()) or bool(((flat == 0) | (flat == 1)).all()):
                continue
            learned = self.g.param[a]
            what = "a learned factor" if learned else "a factor that varies by head or position"
            self._unmodelled(f"{what} multiplying the scores", op.location)

    def _learned_term(self, op: Op, reach: set[int], core: Core) -> None:
        """A term mixed into the scores that is made from the queries or keys together with
        a learned table of the layer's own (``q @ pos_emb``: the content-to-position terms
        of relative attention, Shaw's, Transformer-XL's, DeBERTa's; CoPE's interpolated
        position logits): nothing the reference models. The projections' weights and what
        the queries and keys went through on their way are not that table."""
        ends = {core.q_node, core.k_node}
        stops = set(self.s.projection_ops) | ends

        def table(i: int) -> bool:
            o = self.ops[i]
            return o.leaf is not None and o.leaf.startswith("param:") and o.output.dim() >= 2

        for a in op.args:
            if a in reach or not self.g.tainted[a]:
                continue
            above = self.g.ancestors(a, stop=stops, every=True) - stops
            # a product of the queries (or keys) with the table itself: not a gate or a
            # convolution made from the input through weights of their own
            found = any(
                any(table(t) for t in self.ops[i].args)
                and any(self.g.ancestors(t, stop=stops) & ends for t in self.ops[i].args)
                for i in above
            )
            if found:
                self._unmodelled(
                    "a term made from the queries or keys and a learned table of the layer's "
                    "own, mixed into the scores (relative position attention: Shaw's, "
                    "Transformer-XL's, DeBERTa's; contextual positions, CoPE?)",
                    op.location,
                )
                return

    def _shifted_sigmoid(self, op: Op, reach: set[int]) -> None:
        """A sigmoid of the scores shifted by a constant: sigmoid attention (its bias b,
        ``-log n`` in Apple's design). A shift a softmax would ignore (it is shift-invariant)
        is written for a normaliser that is no softmax: a design, not a sigmoid written in
        the softmax's place (that is ``not_softmax``)."""
        for i in sorted(self.g.ancestors(op.index) & reach):
            step = self.ops[i]
            if step.name not in _SHIFT_OPS:
                continue
            sign = -1.0 if step.name in ("sub", "__sub__", "sub_") else 1.0
            shift = [sign * a for a in step.call_args if isinstance(a, (int, float)) and a != 0]
            for a in step.args:
                if a in reach or self.g.tainted[a]:
                    continue
                t = self.ops[a].output.detach()
                if t.numel() and t.is_floating_point():
                    flat = t.flatten()
                    if bool((flat == flat[0]).all()) and bool(torch.isfinite(flat[0])):
                        shift += [sign * float(flat[0])] if float(flat[0]) != 0 else []
            if shift:
                self._refuse(
                    "sigmoid attention (weights = sigmoid(scores + b) with a constant b = "
                    f"{shift[0]:.4g}, each weight on its own: no softmax normalisation over "
                    "the keys)",
                    op.location,
                )

    def _mixed_scores(self, op: Op, end: int, after_softmax: set[int]) -> None:
        """A product of the scores (or weights) with a matrix of their own (talking heads: a
        1x1 convolution or an einsum mixing each position's score maps across the heads)."""
        if op.name not in _SCORE_MIXING or op.index == end:
            return
        fixed = [a for a in op.args if not self.g.tainted[a] and self.ops[a].output.numel() > 1]
        if not fixed:
            return
        learned = any(self.g.param[a] for a in fixed)
        what = "a learned map" if learned else "a fixed matrix"
        maps = "weights" if any(a in after_softmax for a in op.args) else "scores"
        self._unmodelled(
            f"the {maps} mixed across heads by {what} ({op.name}: talking heads?)", op.location
        )

    def _combined_softmaxes(self, op: Op, reach: set[int], after_softmax: set[int]) -> None:
        """Weights that add or subtract two maps made by softmaxes (differential attention:
        one softmax map minus a multiple of another)."""
        if op.name not in _COMBINE:
            return
        made = {a for a in op.args if a in after_softmax and a in reach}
        if not made:
            return
        # the other map from a product of its own (differential attention's second half
        # of the heads): made by a softmax, off the first scores' path
        made |= {
            a
            for a in op.args
            if a not in made and self.g.tainted[a] and self.g.ancestors(a) & self._softmaxes
        }
        if len(made) >= 2:
            self._unmodelled(
                "attention weights combined from two softmax maps (one subtracted from or "
                "added to another: differential attention?)",
                op.location,
            )

    def _multiplied_softmaxes(self) -> None:
        """Two maps made by softmaxes multiplied together (Nystromformer's
        ``softmax(Q L^T) pinv(softmax(L L^T)) softmax(L K^T)``: the softmax approximated
        through landmarks). What a softmax made is followed up to the next weight (a next
        layer's projections read a context made by one: they start afresh)."""
        made: set[int] = set()
        for op in self.ops:
            if op.name in ("softmax", "_softmax", "softmax_"):
                made.add(op.index)
                continue
            if not any(a in made for a in op.args) or any(self.g.param[a] for a in op.args):
                continue
            if op.name in MATMULS and sum(a in made for a in set(op.args)) >= 2:
                # no reading of one softmax's weights can hold this layer: refused outright
                self._refuse(
                    "attention weights made as a product of softmax maps (the softmax "
                    "approximated through landmarks, Nystromformer's?)",
                    op.location,
                )
            made.add(op.index)

    def _score_path(self, core: Core) -> None:
        s = self.s
        self._keys_axis = None
        if core.fused is not None:
            return self._fused_masks(core)
        self._added_in_product(core.score)
        start = core.score.index
        end = core.context.index
        reach = {start}
        for op in self.ops[start + 1 : end + 1]:
            if any(a in reach for a in op.args):
                reach.add(op.index)
        after_softmax: set[int] = set()  # made from a softmax (or its exp) on the path
        self._keys_axis = self._softmax_axis(reach)
        for i in sorted(reach):
            op = self.ops[i]
            if op.name == "tanh" and s.softcap is None and self._softmax_after(i, reach):
                # capped, then a softmax (a tanh in the softmax's place is not_softmax)
                s.softcap = op.location or "the scores"
            if op.name in ("cat", "concat", "concatenate") and i != start:
                joined = [a for a in op.args if not self.g.tainted[a]]
                if joined:  # a column joined to the scores: GPT-OSS's sinks, an extra zero
                    learned = any(self.g.param[a] for a in joined)
                    what = "a learned logit (attention sink)" if learned else "a constant logit"
                    self._refuse(f"{what} joined to the scores before the softmax", op.location)
            if i != start and not after_softmax and op.name in _SCALAR_OPS:
                moved = [a for a in op.args if a in reach]
                factor = constant_factor(self.g, op, moved[0]) if len(moved) == 1 else None
                if factor is not None:
                    s.score_factors.append(factor)
            if i != start:
                self._varying_factor(op, reach)
                if i not in after_softmax:
                    self._learned_term(op, reach, core)
                self._mixed_scores(op, end, after_softmax)
                self._combined_softmaxes(op, reach, after_softmax)
            if op.name in ("sigmoid", "sigmoid_") and i != start:
                self._shifted_sigmoid(op, reach)
            if op.name in ("erf", "erfc", "special_erf") and not after_softmax:
                # a Gaussian CDF of the scores: MEGA's Laplace attention function, a design
                # in the softmax's place (no slip writes an erf)
                self._unmodelled(
                    "attention weights made by an erf of the scores (the Laplace attention "
                    "function of MEGA?) in the softmax's place",
                    op.location,
                )
            if op.name in _ADDS and i != start:
                self._input_bias(op, reach)
            if op.name in _SOFTMAX_CALLS or any(a in after_softmax for a in op.args):
                after_softmax.add(i)
            if op.name not in MASKING_OPS or i == start:
                continue
            self._unread = None
            evidence = self._mask_of(op, reach)
            if evidence is None and self._unread is not None:
                # it hides some scores, in a layout no reading placed: judged without it, a
                # correct layer would fail; refused instead unless a mistake explains it
                self._unmodelled(
                    f"a mask on the scores in a layout not read ({self._unread} hiding some keys)",
                    op.location,
                )
            if evidence is None:
                continue
            kind, detail = evidence
            if kind == "band":
                self._refuse(detail, op.location)
            if kind == "bias":
                s.bias = BiasSeen(
                    self._bias_seen, tuple(op.output.shape), op.location, learned=self._learned
                )
                s.bias.before_scale = self._scaled_after(op, reach)
                continue
            if kind == "local":  # not causal: a window of keys on either side
                s.window, s.local = (self.window_seen, op.location), f"{detail} at {op.location}"
                continue
            if kind == "window":
                s.window = (self.window_seen, op.location)
                detail = f"a sliding-window mask ({detail})"
            if s.causal is None:
                s.causal = f"{detail} at {op.location}"

    def _input_bias(self, op: Op, reach: set[int]) -> None:
        """A term added to the scores that is made from the input but not from the scores'
        product: a bias that depends on the content (the Forgetting Transformer's summed
        forget gates, content-to-position terms of relative attention). A mask made from
        the input (0 or very negative only: padding read from token ids) is not one."""
        for a in op.args:
            if a in reach or not self.g.tainted[a]:
                continue
            t = self.ops[a].output.detach()
            if not t.is_floating_point() or t.dim() < 2 or t.numel() <= 1:
                continue
            if bias_like(t):
                self._unmodelled(
                    "a bias made from the input added to the scores (a data-dependent bias: "
                    "a forget gate, or content-to-position terms of relative attention?)",
                    op.location,
                )
                return

    def _softmax_after(self, i: int, reach: set[int]) -> bool:
        """Whether a softmax (or its exp) is made from this op's output on the score path."""
        made = {i}
        for op in self.ops[i + 1 :]:
            if op.index in reach and any(a in made for a in op.args):
                if op.name in ("softmax", "_softmax", "log_softmax", "exp", "exp2"):
                    return True
                made.add(op.index)
        return False

    def _added_in_product(self, op: Op) -> None:
        """``baddbmm(bias, q, k)``: a tensor added in the scores' own product (zeros, a
        mask, or a position bias as BLOOM adds its ALiBi)."""
        if op.name not in ("baddbmm", "addmm", "addbmm") or not op.call_args:
            return
        added = op.call_args[0]
        beta = op.call_kwargs.get("beta", 1)
        if not isinstance(added, torch.Tensor) or added.dim() < 1 or beta == 0:
            return
        if bias_like(added):
            learned = bool(op.args) and self.g.learned(op.args[0])
            # baddbmm(bias, q, k^T, alpha=scale): the bias is not scaled
            self.s.bias = BiasSeen(
                added.detach(), tuple(op.output.shape), op.location, learned=learned
            )

    def _scaled_after(self, op: Op, reach: set[int]) -> bool:
        """Whether the scores are scaled after this op adds the bias (Falcon's order), before
        the softmax: by factors that do not cancel (CogView's ``softmax((x / a - max) * a)``
        scales by ``1 / a`` and back, no scale)."""
        net = 1.0
        for later in self.ops[op.index + 1 :]:
            if later.index not in reach:
                continue
            if later.name in _SOFTMAX_CALLS:
                break
            if later.name not in _SCALAR_OPS:
                continue
            scalars = [float(a) for a in later.call_args if isinstance(a, (int, float))]
            scalars += [
                float(self.ops[a].output)
                for a in later.args
                if a not in reach and self.ops[a].output.numel() == 1
            ]
            if not scalars:
                continue
            if later.name == "__rtruediv__" or any(c == 0 for c in scalars):
                return True  # a factor divided by the scores: no plain scale, said as one
            for c in scalars:
                net = net / c if later.name in ("div", "__truediv__", "div_") else net * c
        return abs(net - 1.0) > 1e-6

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
            # where(hide, fill, scores) keeps the scores where the condition is false; a
            # number as the fill is no tensor node, so the call's own second argument says
            filled_first = len(op.call_args) > 1 and not isinstance(op.call_args[1], torch.Tensor)
            scores_first = not filled_first and len(op.args) > 1 and op.args[1] in reach
            return self._judge_hidden(~c if scores_first else c, "torch.where")
        t = consts[0][1]
        if t.numel() <= 1 or t.dim() < 2:
            return None
        if name in ("mul", "__mul__", "__rmul__", "mul_"):
            return self._judge_hidden(t == 0, "a multiplicative mask")
        if name in ("sub", "__sub__", "sub_", "__isub__"):
            if consts[0][0] == 0:
                return None  # a tensor minus the scores: the scores negated, not a bias
            t = -t  # the scores minus a tensor: that tensor's negative added
        # additive: a mask (0 / very negative) or a bias (many finite values)
        t64 = t.double()
        if bias_like(t64):
            self._learned = self.g.learned(op.args[consts[0][0]])
            self._bias_seen = t
            return ("bias", "a position bias added to the scores")
        hidden = hides(t64)
        if not bool(hidden.any()) and bool((t64 > 1e4).any()):
            # the cells a mask hides, filled with a huge positive value: a mask with its sign
            # flipped (``-finfo.min``) is still where the layer masks (the judge names it)
            return self._judge_hidden(t64 > 1e4, "an additive mask of huge positive values")
        low = _lower_triangle_kept(t64) if not bool(hidden.any()) else None
        if low is not None:
            return self._judge_hidden(low, "an additive mask of two finite values")
        return self._judge_hidden(hidden, "an additive mask")

    def _softmax_axis(self, reach: set[int]) -> int | None:
        """The axis the scores' softmax normalises, counted from the end (-1: the keys are
        last, as usual), where a softmax on the path says; None where none does."""
        for i in sorted(reach):
            op = self.ops[i]
            if op.name not in ("softmax", "_softmax", "log_softmax") or not op.args:
                continue
            dim = op.call_args[1] if len(op.call_args) > 1 else op.call_kwargs.get("dim")
            if isinstance(dim, int):
                n = self.ops[op.args[0]].output.dim()
                return dim - n if dim >= 0 else dim
        return None

    def _judge_hidden(self, hidden: T, how: str) -> tuple[str, str] | None:
        keys = self._keys_axis
        if keys is not None and keys < -1 and hidden.dim() >= -keys:
            # scores laid out keys first, queries last (Apple's Neural Engine layout
            # (b, keys, 1, queries), softmax over axis 1): the mask read queries by keys,
            # where it reads so and not as laid out (a softmax over the wrong axis of
            # usual scores keeps its mask's reading)
            moved = tokens_last(hidden.movedim(keys, -1))
            if mask_shape(tokens_last(hidden)) is None and mask_shape(moved) is not None:
                hidden = moved
        hidden = tokens_last(hidden)
        shape = mask_shape(hidden)
        lead = self._lead()
        if shape is None and _packed_batch(hidden, lead):
            return None  # sequences packed into one: each sees its own (the output shows)
        leak = _packed_leak(hidden, lead) if shape is None else None
        if leak is not None:
            # sequences packed into one whose mask lets a query see another's keys: the
            # judge reproduces the output with this mask (batch_mixing), else refuses
            self.s.packed_leak = (leak, None)
            self._unread = f"{how} letting queries see keys of other sequences packed beside"
            return None
        if shape is None:
            chunk = causal_chunks(hidden)
            if chunk is not None and _packed_rows(hidden, lead, chunk):
                # chunks as long as the probe's sequences over all the batch's tokens: the
                # batch packed into one, each sequence causal (a varlen kernel's stand-in)
                return (
                    "mask",
                    f"a causal mask within each sequence of a batch packed into one ({how})",
                )
            if chunk is not None:
                return (
                    "band",
                    f"chunked attention (each query sees the keys of its own chunk of {chunk} "
                    f"tokens up to itself: a block-diagonal causal mask, {how})",
                )
            if _other_pattern(hidden):
                return (
                    "band",
                    f"a mask of another pattern than causal, a sliding window or none "
                    f"(attention sinks, a prefix, packed documents?: {how})",
                )
            if bool(hidden.any()) and not bool(hidden.all()) and not _causal_slice(hidden):
                self._unread = how
            return None
        kind, d = shape
        if kind == "window":
            self.window_seen = d
            return ("window", f"each query sees {d} keys, itself included")
        if kind == "band":
            self.window_seen = 2 * d + 1
            return (
                "local",
                f"a bidirectional sliding window (local attention: each query "
                f"sees the keys within {d} positions on either side, {how})",
            )
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
            self._unread = None
            if mask.dtype == torch.bool:
                found = self._judge_hidden(~mask, "a boolean attn_mask")
            else:
                m = mask.double()
                if bias_like(m):
                    node = next(
                        (
                            a
                            for a in op.args
                            if self.ops[a].output.shape == mask.shape
                            and torch.equal(self.ops[a].output, mask)
                        ),
                        None,
                    )
                    learned = node is not None and self.g.learned(node)
                    self.s.bias = BiasSeen(
                        mask.detach(),
                        tuple(op.output.shape[:-1]) + (mask.shape[-1],),
                        op.location,
                        learned=learned,
                    )
                hidden = hides(m)
                low = _lower_triangle_kept(m) if not bool(hidden.any()) else None
                found = self._judge_hidden(
                    hidden if low is None else low,
                    "an additive attn_mask" + ("" if low is None else " of two finite values"),
                )
            if found is None and self.s.packed_leak is not None and self._unread:
                # refused unless the judge reproduces the output with it (batch_mixing)
                self._unmodelled(f"a mask on the scores ({self._unread})", op.location)
            if found is not None:
                kind, detail = found
                if kind == "band":
                    self._refuse(detail, op.location)
                if kind == "local":  # not causal: a window of keys on either side
                    self.s.window = (self.window_seen, op.location)
                    self.s.local = f"{detail} at {op.location}"
                    return
                if kind == "window":
                    self.s.window = (self.window_seen, op.location)
                    detail = f"a sliding-window mask ({detail})"
                self.s.causal = self.s.causal or f"{detail} at {op.location}"
