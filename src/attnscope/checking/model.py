"""Check a whole model: every attention layer, on the inputs it really gets.

The model runs the way it is meant to (token ids within its vocabulary, or hidden states for a
stack of layers); one recorded run finds every attention layer by what it computes
(:func:`.structure.attention_layers`), in the order the model runs them. Each layer is then
checked by the single-layer checker where it sits: the model runs on its own input, the
layer's hidden states are swapped for the probe on the way in (its other arguments, masks and
position embeddings, are the ones the model makes), and only the layer's own computation is
recorded.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import AttnScopeError
from ..stages import Kind, Stage
from .compare import close
from .dataflow import Graph
from .decode import PROMPT, START, STEPS, check_decoding, decode_protocol
from .features import bias_like
from .probe import BATCH, ModuleProbe, first_tensor
from .record import Recorder, tensors_in
from .report import CheckReport, Failure, ModelReport, StageCheck
from .structure import attention_layers
from .target import Target, call_safely

__all__ = ["ModelHost", "check_model", "token_vocabulary"]


#: calls that pass token ids on unchanged in value (a cast, a new shape)
_ID_PASSING = {
    "view",
    "reshape",
    "flatten",
    "long",
    "int",
    "to",
    "contiguous",
    "unsqueeze",
    "squeeze",
    "clone",
    "detach",
    "type",
    "expand",
    "__getitem__",
    "transpose",
    "t",
    "permute",
}


#: calls that shift ids along, with pads or others' ids beside them (Trax's ``ShiftRight``:
#: a column of zeros put before the ids and the last one cut off): ids still
_ID_JOINING = {"cat", "concat", "concatenate", "roll", "pad"}


class _Found(Exception):
    pass


#: calls that hand a table on as another view or copy of itself
_TABLE_VIEWS = {"t", "transpose", "permute", "contiguous", "to", "float", "double", "detach"}
_TABLE_VIEWS |= {"__get__"}  # the ``.T`` and ``.mT`` properties


class _TableLookup(TorchFunctionMode):
    """Watches a model's first calls on token ids for the one that looks them up in a table:
    a 2-D floating parameter or buffer of the model indexed by the ids (``W_E[tokens]``,
    ``F.embedding(tokens, W)``, ``W.index_select(0, tokens)``); its rows are the vocabulary."""

    def __init__(self, model: nn.Module, ids: torch.Tensor):
        super().__init__()
        self.tables = {
            id(t)
            for t in (*model.parameters(), *model.buffers())
            if t.dim() == 2 and t.is_floating_point()
        }
        self.ids = {id(ids)}
        self.keep = [ids]  # alive, so that their ids are not reused
        self.vocab: int | None = None

    def _is_ids(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.ids

    def _table(self, func, args, kwargs) -> torch.Tensor | None:
        name = getattr(func, "__name__", "")
        args = list(args)
        if name == "embedding" and len(args) >= 2:  # F.embedding(ids, w); torch.embedding(w, ids)
            a, b = args[0], args[1]
            if self._is_ids(a) and isinstance(b, torch.Tensor):
                return b
            if self._is_ids(b) and isinstance(a, torch.Tensor):
                return a
        if name == "__getitem__" and len(args) == 2 and isinstance(args[0], torch.Tensor):
            index = args[1]
            first = index[0] if isinstance(index, tuple) and index else index
            rest = index[1:] if isinstance(index, tuple) else ()
            whole = all(r is Ellipsis or (isinstance(r, slice) and r == slice(None)) for r in rest)
            if self._is_ids(first) and whole:
                return args[0]
        if name == "index_select":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            index = args[2] if len(args) > 2 else kwargs.get("index")
            if dim == 0 and self._is_ids(index) and isinstance(args[0], torch.Tensor):
                return args[0]
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        table = self._table(func, args, kwargs)
        if table is not None and id(table) in self.tables:
            self.vocab = table.shape[0]
            raise _Found
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (
            name in _TABLE_VIEWS
            and args
            and isinstance(args[0], torch.Tensor)
            and id(args[0]) in self.tables
            and isinstance(out, torch.Tensor)
            and out.dim() == 2
        ):
            # the table as the model reads it: a tied output weight transposed
            # (Praxis's ``w.t()[ids]``), cast or made contiguous
            self.tables.add(id(out))
            self.keep.append(out)
        passed = name in _ID_PASSING and args and self._is_ids(args[0])
        joined = name in _ID_JOINING and any(self._is_ids(t) for t in tensors_in(args))
        if (passed or joined) and isinstance(out, torch.Tensor) and not out.is_floating_point():
            self.ids.add(id(out))
            self.keep.append(out)
        return out


def _looked_up_vocabulary(model: nn.Module, timeout: float | None) -> int | None:
    """The vocabulary read from the computation: the rows of the table the model's first
    look-up on token ids reads (:class:`_TableLookup`); None where it looks none up."""
    ids = torch.zeros(BATCH, 7, dtype=torch.long)  # id 0 is in every vocabulary
    watch = _TableLookup(model, ids)
    extra = _call_extras(model, ids, _model_width(model), second_inputs(model))

    def run():
        with watch:
            model(ids, **extra)

    call_safely(run, timeout=timeout)
    return watch.vocab


def token_vocabulary(model: nn.Module, timeout: float | None = None) -> int | None:
    """The vocabulary size of the table the model looks its input up in, read from what it
    computes (:func:`_looked_up_vocabulary`); failing that, of its first ``nn.Embedding``
    (None: it takes vectors)."""
    found = _looked_up_vocabulary(model, timeout)
    if found is not None:
        return found
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None


@dataclasses.dataclass
class ModelHost:
    """The model around the layers checked: how to run it (on token ids below ``vocab``, or
    on vectors ``width`` wide), and what it hands each layer, captured once per input size
    on one run of the whole model and then reused by every probe of every layer."""

    model: nn.Module
    path: str  # the layer being checked (set per layer)
    vocab: int | None
    width: int | None  # the model's input width when it takes vectors
    timeout: float | None
    layers: list[nn.Module] = dataclasses.field(default_factory=list)
    seed: int = 0
    _inputs: dict = dataclasses.field(default_factory=dict)
    _arguments: dict = dataclasses.field(default_factory=dict)
    #: a model of vectors that takes them tokens first, ``(T, B, d)`` (see :func:`_tokens_first`)
    tokens_first: bool = False
    #: the inputs its forward is handed another sequence in (:meth:`memory`): those it
    #: requires (:func:`second_inputs`), or the optional one that runs its cross-attention
    sequences: list[str] = dataclasses.field(default_factory=list)

    def call(self, x: torch.Tensor):
        """Run the model on ``x`` (ids or vectors): ``(output, None)`` or ``(None, error)``.

        Without its key/value cache: the arguments a layer gets are replayed to it many
        times, and a cache would grow with every replay. A forward that needs the position
        its tokens start at (Meta's Llama: ``forward(tokens, start_pos)``) gets 0; one that
        requires a second sequence (a decoder's ``forward(tgt, memory)``) gets
        :meth:`memory`."""
        extra = _call_extras(self.model, x, self.width, self.sequences, self.memory)
        result, err = call_safely(self.model, x, timeout=self.timeout, **extra)
        return (None, err) if err is not None else (first_tensor(result), None)

    def input(self, b: int, n: int, gen: torch.Generator | None = None) -> torch.Tensor:
        """The model's input for ``b`` sequences of ``n`` tokens (the same every time)."""
        if (b, n) not in self._inputs:
            g = torch.Generator().manual_seed(self.seed + 7919 * b + n)
            if self.vocab is not None:
                self._inputs[(b, n)] = torch.randint(0, self.vocab, (b, n), generator=g)
            elif self.tokens_first:
                self._inputs[(b, n)] = torch.randn(n, b, self.width, generator=g)
            else:
                self._inputs[(b, n)] = torch.randn(b, n, self.width, generator=g)
        return self._inputs[(b, n)]

    def memory(self, b: int, n: int) -> torch.Tensor:
        """The second sequence a model that requires one gets beside its input of ``b``
        sequences of ``n`` tokens (an encoder's output for a decoder): ``(b, n + 3, width)``,
        longer than the input (keys or values read from the wrong one then show), the same
        tensor every time."""
        if ("memory", b, n) not in self._inputs:
            g = torch.Generator().manual_seed(self.seed + 104729 + 7919 * b + n)
            self._inputs[("memory", b, n)] = torch.randn(b, n + 3, self.width, generator=g)
        return self._inputs[("memory", b, n)]

    def learned_arguments(self, layer: nn.Module, b: int, n: int) -> set:
        """The arguments (positions or names) the model hands ``layer`` for an input of that
        size that it made from its trainable parameters alone, not from the input: a
        relative position bias the model computes once for every layer (T5's, MPNet's).
        Read for every layer on one recorded run of the model, once per size."""
        got = self.arguments(layer, b, n)
        if isinstance(got, str) or not any(_bias_like(a, n) for a in tensors_in(got)):
            return set()  # nothing handed that could be a bias: no recorded run
        key = ("learned", b, n)
        if key not in self._arguments:
            self._arguments[key] = self._learned_by_layer(b, n)
        return self._arguments[key].get(id(layer), set())

    def _learned_by_layer(self, b: int, n: int) -> dict[int, set]:
        leaves = {id(p): f"param:{name}" for name, p in self.model.named_parameters()}
        x = self.input(b, n)
        leaves[id(x)] = "input:0"
        if self.sequences:
            leaves[id(self.memory(b, n))] = "input:memory"
        handed: dict[int, list] = {}

        def grab(mod, args, kwargs):
            handed.setdefault(id(mod), [*enumerate(args), *kwargs.items()])

        layers = self.layers or []
        hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in layers]
        rec = Recorder(leaves, self.model)
        try:
            with rec:
                _, err = self.call(x)
        finally:
            for h in hooks:
                h.remove()
        if err is not None:
            return {}
        g = Graph(rec)
        out: dict[int, set] = {}
        for layer, given in handed.items():
            for k, a in given:
                node = rec.node_of(a) if isinstance(a, torch.Tensor) else None
                if node is not None and a.is_floating_point() and g.learned(node):
                    out.setdefault(layer, set()).add(k)
        return out

    def is_memory(self, t: object) -> bool:
        """Whether ``t`` is a second sequence this host handed the model (:meth:`memory`)."""
        return any(
            t is m
            for key, m in self._inputs.items()
            if isinstance(key, tuple) and key[0] == "memory"
        )

    def arguments(self, layer: nn.Module, b: int, n: int) -> tuple[tuple, dict] | str:
        """What the model hands ``layer`` for an input of that size: ``(args, kwargs)``, or
        the error the model raised on the way."""
        key = (b, n)
        if key not in self._arguments:
            seen: dict[int, tuple[tuple, dict]] = {}

            def grab(mod, args, kwargs):
                # as handed, before the layer runs: a cache object it then fills is kept
                # as it was (see _State)
                seen[id(mod)] = (
                    tuple(_State.of(a) for a in args),
                    {k: _State.of(a) for k, a in kwargs.items()},
                )

            hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in self.layers]
            try:
                _, err = self.call(self.input(b, n))
            finally:
                for h in hooks:
                    h.remove()
            self._arguments[key] = seen if seen else (err or "the model called no layer")
        got = self._arguments[key]
        if isinstance(got, str):
            return got
        if id(layer) not in got:
            return f"the model did not call {self.path!r}"
        args, kwargs = got[id(layer)]
        return tuple(_State.fresh(a) for a in args), {k: _State.fresh(a) for k, a in kwargs.items()}


def _bias_like(t: torch.Tensor, n: int) -> bool:
    """A float tensor token by token (``(..., n, n)``) that is a bias, not a mask."""
    ok = t.is_floating_point() and t.dim() >= 2 and tuple(t.shape[-2:]) == (n, n)
    return ok and bias_like(t)


class _State:
    """An object of the model's own handed to a layer (a per-layer cache it appends the
    keys to, a state bag counting steps), copied as it was when handed: every replay of
    the layer gets it in that state, not as the last replay left it (a cache grown by
    every probe would join old keys to each new call)."""

    def __init__(self, obj):
        self.obj = obj

    @staticmethod
    def of(a):
        if not _stateful(a):
            return a
        try:
            return _State(copy.deepcopy(a))
        except Exception:  # noqa: BLE001  (an object that cannot be copied: as handed)
            return a

    @staticmethod
    def fresh(a):
        return copy.deepcopy(a.obj) if isinstance(a, _State) else a


def _stateful(a) -> bool:
    """An instance of a plain class of the model's (not a tensor, module, number, string,
    container or function) that holds no module or parameter (copying those would make
    weights the recorder does not know)."""
    if isinstance(a, (torch.Tensor, nn.Module, int, float, bool, str, bytes, tuple, list, dict)):
        return False
    if a is None or callable(a) or isinstance(a, type) or not hasattr(a, "__dict__"):
        return False
    held = list(vars(a).values())
    return not any(isinstance(v, (nn.Module, nn.Parameter)) for v in held)


#: methods a model whose caches must be made before any call has (gpt-fast's Transformer)
_SETUPS = ("setup_caches", "setup_cache", "allocate_kv_cache")


def _takes(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _required(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward has a parameter ``name`` without a default."""
    try:
        p = inspect.signature(module.forward).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return p is not None and p.default is p.empty


def second_inputs(module: nn.Module) -> list[str]:
    """The parameters of ``module``'s forward after its input that have no default and are
    not masks, positions or a start: the sequences it requires beside its input (a decoder's
    ``forward(tgt, memory)``, a Whisper-style ``forward(tokens, xa)``)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and not re.search(r"mask|pos|start|cache", p.name)
    ]


def _call_extras(
    model: nn.Module, x: torch.Tensor, width: int | None, sequences: list[str], memory=None
) -> dict:
    """The arguments besides ``x`` a model is called with: no cache, its start position 0,
    and another sequence in each of ``sequences`` (``memory(b, n)``; by default vectors
    ``(b, n + 3, width)`` drawn here)."""
    extra: dict = {"use_cache": False} if _takes(model, "use_cache") else {}
    if _required(model, START):
        extra[START] = 0
    if sequences and width is not None:
        b, n = x.shape[:2]
        for name in sequences:
            extra[name] = memory(b, n) if memory is not None else torch.randn(b, n + 3, width)
    return extra


def _tokens_first(host: ModelHost) -> bool:
    """Whether a model of vectors takes them tokens first, ``(T, B, d)`` (PyTorch's
    ``nn.TransformerEncoder`` unless ``batch_first``), read from what it computes: its
    sequences are independent, so changing the first slice along the batch axis changes
    that slice of the output alone; along axis 0 that is so batch first, along axis 1
    tokens first (every token of a sequence sees its first one)."""
    g = torch.Generator().manual_seed(host.seed + 1)
    x = torch.randn(3, 5, host.width, generator=g)

    def run(t: torch.Tensor) -> torch.Tensor | None:
        out, err = host.call(t)
        ok = err is None and isinstance(out, torch.Tensor) and out.shape[:2] == t.shape[:2]
        return out.detach().double() if ok else None

    base = run(x)
    if base is None:
        return False

    def only_first_changed(axis: int) -> bool | None:
        y = x.clone()
        y.select(axis, 0).add_(1.0)
        out = run(y)
        if out is None:
            return None
        moved = (out - base).abs().movedim(axis, 0).flatten(1).amax(1)
        return bool(moved[0] > 1e-6 and (moved[1:] <= 1e-6 * (1 + base.abs().max())).all())

    if only_first_changed(0):
        return False
    return bool(only_first_changed(1))


def _stack_of(path: str, layer: nn.Module) -> tuple:
    """Layers of one stack: at the same place in each repeated block (the path with its
    indices wildcarded: ``h.*.attn``), with the same parameters (names and shapes), of one
    class or not (OpenCLIP's towers mix block types: torch's ``nn.MultiheadAttention`` in
    some blocks, its own ``Attention`` with the same parameters in others). An encoder's and
    a decoder's stacks are different places (``encoder.layers.*.self_attn``,
    ``decoder.layers.*.self_attn``)."""
    shapes = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path), shapes


def _stacks(reports, layers) -> list[list[int]]:
    """The indices of the layers of each stack (:func:`_stack_of`), in the model's order."""
    stacks: dict[tuple, list[int]] = {}
    for i, ((path, _), layer) in enumerate(zip(reports, layers, strict=True)):
        stacks.setdefault(_stack_of(path, layer), []).append(i)
    return list(stacks.values())


def _stacks_as_one(reports, layers, tgt, host, seed, timeout, tokens):
    """With the kind inferred, the layers of one stack (:func:`_stack_of`) are one kind: where
    some mask the future and others do not, the others are checked as the causal kind their
    stack is (a decoder whose later layers were built without their mask, x-transformers'
    ``attn_kwargs.pop("causal")`` in its build loop)."""
    out = list(reports)
    for members in _stacks(reports, layers):
        kinds = [Kind.of(reports[i][1].kind) for i in members]
        causal = [i for i, k in zip(members, kinds, strict=True) if k.causal]
        if not causal or len(causal) == len(members) or any(k.cross for k in kinds):
            continue
        first = reports[causal[0]][0]
        for i, k in zip(members, kinds, strict=True):
            if k.causal:
                continue
            path, layer = reports[i][0], layers[i]
            host.path = path
            sub = Target(layer, f"{tgt.text} {path}", "instance")
            want = Kind.weighted_kind(causal=True, multihead=k.multihead)
            report = ModuleProbe(sub, want, seed, timeout, None, tokens, host=host).run()
            report.kind_reason = (
                f"inferred: the layers of its stack are causal ({first} masks the future; "
                "this one, of the same class and shapes at the same place in its block, "
                "does not)"
            )
            out[i] = (path, report)
    return out


def _multiplier_of_one(reports, probes, layers, tgt, host, seed, timeout, tokens, kind):
    """A failing layer whose queries or keys carry a constant read as a muP multiplier (no
    power of its sizes, part of the scale), where the other layers of its stack
    (:func:`_stack_of`) carry none and pass: a multiplier of the weights is the model's, the
    same in every layer, so this one is a slip in the scale (THUMT's ``64 // 4 ** -0.5``,
    the parentheses lost: the queries times 128) and the layer is judged again with the
    constant as it stands. Only a failing layer is judged again: a layer that passes with
    a factor of its own stays passed, so this reading can name a slip otherwise, never
    make one."""
    out = list(reports)
    for members in _stacks(reports, layers):
        plain = [i for i in members if reports[i][1].ok and not probes[i].multipliers]
        if not plain:
            continue
        for i in members:
            (path, report), probe = reports[i], probes[i]
            if report.ok or not probe.multipliers:
                continue
            host.path = path
            sub = Target(layers[i], f"{tgt.text} {path}", "instance")
            again = ModuleProbe(sub, kind, seed, timeout, None, tokens, host=host)
            again.plain_factors = True
            fresh = again.run()
            if fresh.ok:
                continue
            which, factor, where = probe.multipliers[0]
            fresh.notes.append(
                f"the {which} multiplied by {factor:.6g} at {where}: judged as part of the "
                f"scale as written, not as a multiplier of the weights, since the other "
                f"layers of its stack ({reports[plain[0]][0]}) carry no such factor"
            )
            out[i] = (path, fresh)
    return out


def _feeds(host: ModelHost, layer: nn.Module, cross: nn.Module, key) -> bool:
    """Whether ``layer``'s output reaches the other sequence the model hands the
    cross-attention layer ``cross`` (in argument ``key``): its output nudged, that sequence
    moves (an encoder's layer, under a decoder's cross-attention)."""
    b, n = BATCH, 7
    x = host.input(b, n)
    seen: list[torch.Tensor] = []

    def grab(mod, args, kwargs):
        got = args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key)
        if isinstance(got, torch.Tensor):
            seen.append(got.detach().clone())

    g = torch.Generator().manual_seed(host.seed + 31)

    def nudge(mod, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out + torch.randn(out.shape, generator=g).to(out.dtype)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (out[0] + torch.randn(out[0].shape, generator=g).to(out[0].dtype), *out[1:])
        return out

    handle = cross.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        _, err = host.call(x)
        if err is not None or not seen:
            return False
        hook = layer.register_forward_hook(nudge)
        try:
            _, err = host.call(x)
        finally:
            hook.remove()
    finally:
        handle.remove()
    if err is not None or len(seen) < 2 or seen[0].shape != seen[-1].shape:
        return False
    return not torch.allclose(seen[0], seen[-1])


def _encoder_inferred(reports, probes, layers, tgt, host, seed, timeout, tokens):
    """A model's --kind is its decoder's: the self-attention layers whose output reaches the
    other sequence its cross-attention layers read (the encoder's, read from what they
    compute) are checked with their kind inferred."""
    cross = [(p.entry.module, p._cross_key) for p in probes if p.cross and p.entry is not None]
    out = list(reports)
    for i, ((path, report), layer, probe) in enumerate(zip(reports, layers, probes, strict=True)):
        if probe.cross or not any(_feeds(host, layer, c, k) for c, k in cross):
            continue
        host.path = path
        sub = Target(layer, f"{tgt.text} {path}", "instance")
        fresh = ModuleProbe(sub, None, seed, timeout, None, tokens, host=host).run()
        fresh.kind_reason += (
            "; inferred: its output is the other sequence the model's cross-attention reads "
            f"(an encoder's layer), and the model's kind ({report.kind}) is its decoder's"
        )
        out[i] = (path, fresh)
    return out


#: calls that project their input with a learned weight
_PROJECTING = {"linear", "conv1d", "conv2d", "matmul", "__matmul__", "mm", "bmm", "einsum"}


def _projected_buffers(rec: Recorder, model: nn.Module) -> list[torch.Tensor]:
    """Buffers of the model that are data, not tables: made into something (without the
    input or a parameter on the way) that a learned weight of two or more axes projects
    (Whisper with its audio built in: a mel buffer through ``conv1``). A mask, a rotary or
    position table is combined with hidden states, never projected by a weight."""
    buffers = {id(b): b for b in model.buffers() if b.is_floating_point()}
    origin: dict[int, set[int]] = {}
    params: set[int] = set()
    found: dict[int, torch.Tensor] = {}
    for op in rec.ops:
        if op.leaf is not None:
            if op.leaf.startswith("param:"):
                params.add(op.index)
            continue
        if not op.args:
            t = rec._alive[op.index]  # the tensor itself (the op keeps a detached alias)
            if id(t) in buffers:
                origin[op.index] = {id(t)}
            continue
        from_buffers = set().union(*(origin.get(a, set()) for a in op.args))
        weights = [a for a in op.args if a in params and rec.ops[a].output.dim() >= 2]
        if from_buffers and weights and op.name in _PROJECTING:
            found.update({b: buffers[b] for b in from_buffers})
        elif from_buffers and not any(a in params for a in op.args):
            origin[op.index] = from_buffers
    return list(found.values())


def _explained_by_the_layer(decoded, reports: dict, host: ModelHost, model: nn.Module, ids):
    """A decoding that first diverges at a layer whose own check failed, and whose output
    in the model's full pass changes with later tokens (a softmax over the queries: no
    cache can reproduce what the full pass computes from tokens still to come), names no
    cache mistake: the layer's failure is the finding. Any other divergence is as found."""
    if decoded is None or decoded.ok or decoded.layer is None:
        return decoded
    report = reports.get(decoded.layer)
    if report is None or report.ok:
        return decoded
    layer = model.get_submodule(decoded.layer)
    runs: list[list[torch.Tensor]] = []
    hook = layer.register_forward_hook(lambda m, a, out: runs[-1].append(first_tensor(out)))
    try:
        later = ids.clone()
        later[:, -1] = (later[:, -1] + 1) % host.vocab
        for x in (ids, later):
            runs.append([])  # the layer's first output in each run
            _, err = host.call(x)
            if err is not None:
                return decoded
    finally:
        hook.remove()
    firsts = [r[0] if r else None for r in runs]
    if any(f is None for f in firsts) or firsts[0].shape != firsts[1].shape:
        return decoded
    a, b = firsts[0].detach().double(), firsts[1].detach().double()
    axis = next((i for i, n in enumerate(a.shape) if n == ids.shape[1]), None)
    if axis is None:
        return decoded
    n = ids.shape[1]
    if close(a.narrow(axis, 0, n - 1), b.narrow(axis, 0, n - 1)):
        return decoded  # causal in the model: the divergence is the cache's
    failure = report.first_failure
    return dataclasses.replace(
        decoded,
        mistake=None,
        message=(
            f"step {decoded.step}, layer '{decoded.layer}': the cached step differs from the "
            "full pass, and this layer's output in the full pass changes with later tokens "
            f"(its own failure: {failure.stage.value} {failure.mistake}): no cache can match "
            "it, so no cache mistake is named"
        ),
    )


def _handed_context(host: ModelHost, probe: ModuleProbe, x: torch.Tensor, memory):
    """The other sequence the model hands ``probe``'s cross layer when it runs on ``x`` with
    ``memory`` beside it (None where the layer is not called)."""
    seen = []

    def grab(mod, args, kwargs):
        k = probe._cross_key
        seen.append(args[k] if isinstance(k, int) and k < len(args) else kwargs.get(k))

    extra = _call_extras(host.model, x, host.width, host.sequences, lambda b, n: memory)
    hook = probe.module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        call_safely(host.model, x, timeout=host.timeout, **extra)
    finally:
        hook.remove()
    return seen[0] if seen and isinstance(seen[0], torch.Tensor) else None


def _memory_unread(reports, probes, host: ModelHost):
    """A model handed a second sequence (a decoder's ``memory``) that hands one of its
    cross-attention layers, as the keys' and values' sequence, one as long as its own input
    (not the memory's length) that changes with that input: the decoder's own hidden
    states, pasted from the self-attention call. That layer's keys come from the wrong
    source, whatever the layer computes from them. (A memory joined to the hidden states,
    Transformer-XL's, is as long as neither.)"""
    names = host.sequences
    if not names or host.width is None:
        return reports
    g = torch.Generator().manual_seed(host.seed + 3)
    n, m = 5, 8  # the input's tokens, the memory's
    memory = torch.randn(BATCH, m, host.width, generator=g)
    one = host.input(BATCH, n)
    two = (
        torch.randint(0, host.vocab, one.shape, generator=g)
        if host.vocab is not None
        else torch.randn(one.shape, generator=g)
    )
    out = list(reports)
    for i, probe in enumerate(probes):
        path, report = out[i]
        if not probe.cross or probe._cross_key is None or not report.ok:
            continue
        a, b = (_handed_context(host, probe, x, memory) for x in (one, two))
        if a is None or b is None or a.shape != b.shape or torch.equal(a, b):
            continue
        if n not in a.shape or m in a.shape:
            continue
        detail = (
            f"the model hands {path!r} the sequence its keys and values read (argument "
            f"{probe._cross_key!r}) as long as its own input and changing with it, not the "
            f"{' or '.join(map(repr, names))} it takes beside it: the keys are made from the "
            "decoder's own hidden states"
        )
        checks = [c for c in report.checks if c.stage.order < Stage.KEYS.order]
        checks.append(StageCheck(Stage.KEYS, False, detail))
        failed = dataclasses.replace(
            report,
            ok=False,
            checks=checks,
            first_failure=Failure(Stage.KEYS, "wrong_source", detail[0].upper() + detail[1:]),
        )
        out[i] = (path, failed)
        break  # the first such layer is the finding
    return out


def _model_width(model: nn.Module) -> int | None:
    for p in model.parameters():
        if p.dim() == 2:
            return p.shape[1]
    return None


def check_model(
    tgt: Target,
    seed: int,
    timeout: float | None,
    tokens: int | None,
    kind=None,
    decode: str | None = None,
    second: str | None = None,
) -> ModelReport:
    """Every attention layer of ``tgt.obj``, checked where it sits (see the module doc), and
    cached decoding against the full pass (``decode``: the protocol, see
    :data:`.decode.PROTOCOLS`; by default read from the model). ``second``: an optional
    input of its forward handed another sequence as well as those it requires (a decoder
    block's ``encoder_hidden_states``, which runs its cross-attention)."""
    model = tgt.obj
    model.eval()
    vocab = token_vocabulary(model, timeout)
    # the width of the vectors a model of vectors takes, and of the second sequence one
    # that requires it gets (a decoder's memory)
    width = _model_width(model)
    gen = torch.Generator().manual_seed(seed + 2)
    n = tokens or 7
    sequences = [*second_inputs(model), *([second] if second else [])]
    probe_host = ModelHost(model, "", vocab, width, timeout, sequences=sequences)
    if vocab is None and width is not None:
        probe_host.tokens_first = _tokens_first(probe_host)
    x = probe_host.input(BATCH, n, gen)
    # parameters named, so that each layer is the innermost module holding its projections
    # as well as its products (not a core module handed queries, keys and values made by
    # its parent: ChatGLM's core_attention)
    leaves = {id(p): f"param:{n}" for n, p in model.named_parameters()}
    leaves[id(x)] = "input:0"
    if sequences:
        leaves[id(probe_host.memory(BATCH, n))] = "input:memory"
    rec = Recorder(leaves, model)
    with rec:
        out, err = probe_host.call(x)
    if err is not None:
        what = f"token ids below {vocab}" if vocab is not None else f"vectors of width {width}"
        setup = next((n for n in _SETUPS if callable(getattr(model, n, None))), None)
        if setup is not None:  # gpt-fast: static caches and positions, set up before any call
            raise AttnScopeError(
                f"{tgt.text}: not supported yet: a model that must be set up with {setup}() "
                f"before it runs (its caches and positions; it raised on {what} "
                f"{tuple(x.shape)}: {err}); check its attention layer class instead"
            )
        raise AttnScopeError(f"{tgt.text}: the model raised on {what} {tuple(x.shape)}: {err}")
    paths = attention_layers(rec, model)
    data = _projected_buffers(rec, model)
    if data:  # a second input the model makes inside (Whisper's mel features): one more run
        leaves.update({id(b): f"input:{i + 1}" for i, b in enumerate(data)})
        rec = Recorder(leaves, model)
        with rec:
            probe_host.call(x)
        paths = attention_layers(rec, model)
    if not paths:
        raise AttnScopeError(f"{tgt.text}: found no attention layer in the model's computation")
    layers = [model.get_submodule(p) for p in paths]
    host = ModelHost(model, "", vocab, width, timeout, layers, seed, sequences=sequences)
    host.tokens_first = probe_host.tokens_first
    reports: list[tuple[str, CheckReport]] = []
    probes: list[ModuleProbe] = []
    for path, layer in zip(paths, layers, strict=True):
        host.path = path
        sub = Target(layer, f"{tgt.text} {path}", "instance")
        probe = ModuleProbe(sub, kind, seed, timeout, None, tokens, host=host)
        reports.append((path, probe.run()))
        probes.append(probe)
    if kind is not None and any(p.cross for p in probes):
        reports = _encoder_inferred(reports, probes, layers, tgt, host, seed, timeout, tokens)
    reports = _memory_unread(reports, probes, host)
    reports = _multiplier_of_one(reports, probes, layers, tgt, host, seed, timeout, tokens, kind)
    if kind is None:
        reports = _stacks_as_one(reports, layers, tgt, host, seed, timeout, tokens)
    decoded = None
    causal = all(Kind.of(r.kind).causal for _, r in reports)
    if decode not in (None, "none"):
        if vocab is not None:  # raises when it does not fit
            decode_protocol(model, decode, host.input(BATCH, PROMPT + STEPS)[:, :PROMPT])
        if vocab is None or not causal:
            what = "takes vectors, not token ids" if vocab is None else "is not causal"
            raise AttnScopeError(
                f"--decode {decode}: expected a causal language model (token ids in); "
                f"{tgt.text} {what}"
            )
    if vocab is not None and causal and decode != "none":  # its cache, step by step
        ids = host.input(BATCH, PROMPT + STEPS)
        decoded = check_decoding(model, list(zip(paths, layers, strict=True)), ids, decode)
        decoded = _explained_by_the_layer(decoded, dict(reports), host, model, ids)
    report = ModelReport.of(tgt.text, reports, decoded)
    report.notes = list(tgt.notes)
    return report
