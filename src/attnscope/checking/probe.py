"""Probe a module: find its attention from what it computes, call it, record what it does.

1. **Discover.** The target is called once on a batch of two sequences, recorded with its
   dataflow; :func:`.structure.read_structure` finds the attention layer (the target, or a
   submodule of a wrapper, block or decoder layer), its projections, heads and mask.
2. **Enter the layer.** A layer inside a wrapper is probed where it sits: the wrapper runs
   on its own input, and the layer's hidden-state argument is swapped for the probe on the
   way in (its other arguments, a mask or positions, are the ones its wrapper passes); its
   output is taken on the way out and the wrapper stops there.
3. **Probe.** The layer is called on a batch of two different sequences (and each alone,
   where it takes unbatched input with the same meaning), each call recorded.

Modules taking ``(query, key, value)``, tokens-first ``nn.MultiheadAttention`` and Hugging
Face layers (which get their causal mask from the model, so it is passed here the way the
model passes it) are called accordingly. The kind, when not given, comes from the
computation: heads from its shapes, causal from a triangular mask on its scores (or, where
none is seen, from outputs that ignore later tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import re
import sys

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import AttnScopeError, describe
from ..functional import alibi_slopes
from ..stages import Kind, Stage
from .alibi import Alibi, is_alibi, is_by_key, is_symmetric, read_slopes
from .binding import Binding, bind_names, bind_structure
from .compare import close
from .dataflow import HANDED, LAYOUT_OPS, Graph
from .features import Unsupported, mask_shape, seen_keys
from .judge import Call, Judge
from .mistakes.projections import WRONG_CUTS, packed_scrambles
from .qknorm import (
    ContextNorm,
    QKNorm,
    eps_on_path,
    gains_on_path,
    read_context_norm,
    read_side,
)
from .record import Op, Recorder, short_path, tensors_in
from .reference import Spec, Weights, project, split
from .relbias import LearnedBias, relative_table, same_for_every_key
from .report import CheckReport, Failure, StageCheck, single_head
from .rotary import Rope, as_heads, fit_tables, read_rope
from .structure import (
    SeveralLayers,
    Structure,
    attention_cores,
    keys_named_first,
    projection_input,
    read_structure,
    stage_of,
)
from .target import SIZES, Target, call_safely

__all__ = ["BATCH", "ModuleProbe", "first_tensor", "fmt_shape", "rebuild_sdpa"]

BATCH = 2
_WEIGHTLESS_WIDTH = 5  # d_in for a module without weights (simplified attention)
_ROPE_BATCH = 6  # sequences of the call a rotation is read from
_WINDOW_PROBE = 40  # tokens of the call a sliding window wider than the probe is read from
#: words in the name of a second input that is another sequence (not a mask or positions)
_SEQUENCE_HINTS = (
    "encoder",
    "context",
    "memory",
    "cross",
    "source",
    "enc_",
    "xa",
    "image",
    "media",
    "vision",
    "visual",
    "audio",
    "kv_input",
    "kv_states",
    "vlm",
    "y",
    "text",
)


def _names_a_sequence(name: str) -> bool:
    """Whether a parameter's name says it is another sequence: a hint within it, or, for
    the short ones (``y``, ``xa``), the whole of one of its words (``rotary_pos_emb`` is
    not ``y``)."""
    low = name.lower()
    words = set(re.split(r"[^a-z0-9]+", low))
    return any(h in words if len(h) <= 2 else h in low for h in _SEQUENCE_HINTS)


#: where a layer (or the config it is built from) says which kind of attention it is
_TYPE_NAMES = ("attn_type", "attention_type", "layer_type", "attn_bias_type")
#: words of an attention type that say it is a windowed (local) one
_LOCAL_WORDS = ("sliding", "local", "window", "swa", "chunk")


def _declares_global(holder) -> bool:
    """Whether ``holder`` declares its attention global (full): an attention type of
    ``GLOBAL``, ``"full_attention"`` or plain ``"causal"`` beside a window size it holds for
    local layers (gemma_pytorch's ``AttentionType``, Hugging Face's layer types, BLT's
    ``attn_bias_type``): a type that names no window."""
    for attr in _TYPE_NAMES:
        v = getattr(holder, attr, None)
        word = getattr(v, "name", v)  # an Enum member by its name
        if isinstance(word, str) and word:
            low = word.lower()
            if not any(w in low for w in _LOCAL_WORDS):
                return True
    return False


#: where layers and configs declare a sliding window (Mistral, Qwen 2, Gemma 2, Phi-3, ...)
#: the attributes a layer or model keeps its configuration in
_CONFIG_HOLDERS = ("config", "cfg", "model_args", "args", "hparams", "hp")

_WINDOW_NAMES = (
    "sliding_window",
    "sliding_window_size",
    "window_size",
    "attention_window",
    "attention_window_size",  # RecurrentGemma's, gemma.cpp's: the query and the keys before it
    "n_swa",  # llama.cpp's hparams: the query and the n_swa - 1 keys before it
    "local_window",  # Samba's (lit-gpt's config): the query and the keys before it
)


def _int_pair(v: object) -> bool:
    """A ``(left, right)`` pair of integers (a window's keys on either side of the query)."""
    return (
        isinstance(v, tuple)
        and len(v) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    )


def _left_only(v: object) -> bool:
    """A ``(left, right)`` window with no key to the right (``(7, 0)``: the query and 7
    keys before it; ``(-1, 0)``: every key before it)."""
    return _int_pair(v) and v[1] == 0


def first_tensor(result: object) -> object:
    """What a call returned, reduced to the attention output: the first tensor of a tuple
    or list, the first tensor of a dict (``{"out": ..., "attn": ...}``) or a dataclass."""
    if isinstance(result, (tuple, list)) and result:
        # the first tensor: Gemma's Flax layers return (new_cache, output), the cache None
        # or a dict where there is none
        return next((r for r in result if isinstance(r, torch.Tensor)), result[0])
    if isinstance(result, dict):
        return next((v for v in result.values() if isinstance(v, torch.Tensor)), result)
    if hasattr(result, "to_tuple"):  # Hugging Face ModelOutput
        return result.to_tuple()[0]
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        found = (getattr(result, f.name) for f in dataclasses.fields(result))
        return next((v for v in found if isinstance(v, torch.Tensor)), result)
    return result


def rebuild_sdpa(rec: Recorder) -> list[Op]:
    """Stages hidden inside fused scaled_dot_product_attention calls, rebuilt from its args."""
    ops: list[Op] = []
    for call in rec.sdpa:
        q, k = call.query.double(), call.key.double()
        if call.enable_gqa and k.dim() == 4 and k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = q @ k.transpose(-2, -1)
        scale = call.scale if call.scale is not None else 1 / math.sqrt(q.shape[-1])
        scaled = scores * scale
        logits = scaled
        if call.is_causal:
            n, m = scaled.shape[-2:]
            hide = torch.ones(n, m, dtype=torch.bool).triu(1)
            logits = scaled.masked_fill(hide, -torch.inf)
        if call.attn_mask is not None:
            mask = call.attn_mask
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask, -torch.inf)
            else:
                logits = logits + mask.double()
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # fully masked rows: 0, as SDPA
        where = call.location
        name = "scaled_dot_product_attention (rebuilt from its arguments)"
        for t in (scores, scaled, logits, weights, call.output):
            ops.append(Op(name, t, where, -1))
    return ops


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _rotations_on_path(path: list[Op], ref: torch.Tensor, b: int, hd: int) -> list:
    """Rotations of the projected heads ``ref`` ``(B, H, T, D)`` seen on the way to the
    scores: tensors between the projection and the scores that are ``ref`` turned (a norm
    may come after one of them, see :func:`.qknorm.read_side`)."""
    found = []
    for op in path:
        t = op.output
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue
        # the whole batch's, or (each sequence run apart) the first sequence's: the path is
        # the first core's, and a rotation's tables are the same for every sequence
        if t.numel() == ref.numel() and t.dim() >= 3:
            whole, seqs = ref, b
        elif b > 1 and t.numel() * b == ref.numel():
            whole, seqs = ref[:1], 1
        else:
            continue
        for form in as_heads(t.detach().to(torch.float64), seqs, ref.shape[1], ref.shape[2], hd):
            tables = fit_tables(whole, form)
            if tables is not None and tables.turns and tables.is_rotation():
                if _same_every_token(tables):
                    # the partner half turned a quarter (rotate_half's swap, interleaved
                    # pairs stacked as (-x2, x1)): a step of the rotation, not one
                    break
                found.append(tables)
                break
        if len(found) >= 2:
            break
    return found


def _same_every_token(t) -> bool:
    """Tables that turn every token by the same angles: no positions in them."""
    return t.cos.shape[-2] > 1 and bool(
        torch.allclose(t.cos, t.cos[..., :1, :], atol=1e-6)
        and torch.allclose(t.sin, t.sin[..., :1, :], atol=1e-6)
    )


def _rotated_in_place(
    rec: Recorder,
    graph: Graph,
    path: list[Op],
    stops: set[int],
    node: int,
    ref: torch.Tensor,
    hd: int,
):
    """The rotation a side went through, read from the layer's own tensors where the
    projected heads ``ref`` do not explain what the scores took: a tensor on the way, only
    moved about from the projection (views, transposes, casts: no arithmetic), that the
    scores' operand is exactly turned from. Heads cut from the wrong axis before the
    rotation then leave the rotation readable, and the stages name the mistake; anything
    computed on the way (a factor not modelled) is not read through. None where no such
    tensor is rotated into the operand."""
    user = _whole(rec, graph, node, ref.numel()).to(torch.float64)
    b, h, n = ref.shape[:3]
    targets = as_heads(user, b, h, n, hd)
    for op in path:
        t = op.output
        if op.index == node or not isinstance(t, torch.Tensor) or t.numel() != ref.numel():
            continue
        if t.is_complex() or not t.is_floating_point() or t.dim() < 3:
            continue
        above = graph.ancestors(op.index, stop=stops) - stops
        if any(rec.ops[i].leaf is None and rec.ops[i].name not in LAYOUT_OPS for i in above):
            continue
        for form in as_heads(t.detach().to(torch.float64), b, h, n, hd):
            for target in targets:
                tables = fit_tables(form, target)
                if tables is not None and tables.turns and tables.is_rotation():
                    return read_side(form, target, [], 0.0, [])
    return None


class _Captured(BaseException):
    """Raised from the layer's forward hook once its output is taken: the wrapper stops
    there (a BaseException, so that the wrapper's own ``except Exception`` lets it by)."""

    def __init__(self, output):
        super().__init__("captured")
        self.output = output


_TIME_WORDS = {"tgt_len", "src_len", "seq_len", "seqlen", "time", "t", "l", "q_len", "sq", "s"}
_BATCH_WORDS = {"bsz", "batch", "batch_size", "b", "bs"}
#: "Time x Batch x Channel", "T x B x C", "(seq_len, batch, embed_dim)"
_TXB = re.compile(
    r"\b(?:T|Time|seq_len|tgt_len|src_len)\s*(?:x|×)\s*(?:B|Batch|bsz)\b"
    r"|\((?:seq_len|tgt_len|src_len)\s*,\s*(?:batch|bsz|batch_size)\s*,"
)


def _mask_like(buf: torch.Tensor) -> bool:
    """Whether a square buffer is a mask (booleans, 0/1, or 0 and a large negative fill),
    not a table of 2 x 2 rotation matrices (BLT's ``freqs_cis``, ``(T, d/2, 2, 2)``)."""
    if buf.dtype == torch.bool:
        return True
    if not buf.is_floating_point() and buf.dtype not in (torch.uint8, torch.int8):
        return False
    values = torch.unique(buf.float())
    return values.numel() <= 2 and bool(((values == 0) | (values == 1) | (values <= -1e4)).all())


def _says_tokens_first(m: nn.Module, params: list) -> bool:
    """Whether a module says it takes ``(tokens, batch, d)`` (fairseq and Megatron layers,
    which have no ``batch_first`` to say so): its forward unpacks its first input as
    ``tgt_len, bsz, embed_dim = query.size()``, or its docstring reads "Time x Batch x
    Channel". Fed batch first, such a layer attends across the batch: the code's own words
    break the tie with a batch-first layer that mixes its sequences (a mistake)."""
    if not params or hasattr(m, "batch_first"):  # it says so in its attribute, if at all
        return False
    forward = type(m).forward
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    first = re.escape(params[0].name)
    unpack = re.search(
        rf"^\s*(\w+)\s*,\s*(\w+)\s*,\s*\w+\s*=\s*{first}\.(?:size\(\)|shape\b)",
        source,
        re.MULTILINE,
    )
    if unpack is not None:
        # the name rebound before it is unpacked (TeleChat's ``hidden_states =
        # hidden_states.transpose(1, 0)``): the layout unpacked is the layer's own, not
        # the one it takes
        rebound = re.search(rf"^\s*{first}\s*=[^=]", source[: unpack.start()], re.MULTILINE)
        if rebound is not None:
            return False
        return unpack[1].lower() in _TIME_WORDS and unpack[2].lower() in _BATCH_WORDS
    docs = (forward.__doc__ or "") + (type(m).__doc__ or "")
    return _TXB.search(docs) is not None


def _batch_major(rec: Recorder, node: int, b: int, n: int) -> bool:
    """Whether a ``(B * T, d)`` tensor was flattened from ``(B, T, ...)`` (sequence after
    sequence), not from tokens first ``(T, B, ...)``: read where its rows were merged."""
    graph = Graph(rec)
    for i in sorted(graph.ancestors(node), reverse=True):
        out = rec.ops[i].output
        if out.dim() == 0 or out.shape[0] != b * n:
            continue
        for a in graph.tainted_args(rec.ops[i]):
            shape = tuple(rec.ops[a].output.shape)
            if len(shape) >= 2 and shape[0] != b * n and shape[0] * shape[1] == b * n:
                return shape[:2] == (b, n)
    return False


def _alibi_like(bias: torch.Tensor, slopes: torch.Tensor) -> bool:
    """Whether ``bias`` ``(B, H, T, T)`` is, where finite, ``slope_h * (j - i)`` plus a
    constant per query row, with slopes of one sign, no two heads alike."""
    if bool((slopes.abs() < 1e-6).any()) or not (
        bool((slopes > 0).all()) or bool((slopes < 0).all())
    ):
        return False
    if slopes.numel() > 1 and len({round(v, 6) for v in slopes.tolist()}) != slopes.numel():
        return False
    e = bias.detach().to(torch.float64)
    n = e.shape[-1]
    j = torch.arange(n, dtype=torch.float64)
    rest = e - slopes.to(torch.float64)[None, :, None, None] * j  # a constant per row left
    finite = torch.isfinite(e) & (e > -1e4)
    lower = torch.ones(n, n, dtype=torch.bool).tril()
    if not bool((finite & lower).any()):
        return False
    rows = rest.masked_fill(~finite, float("nan"))
    spread = (rows.nan_to_num(0) - rows.nanmean(-1, keepdim=True).nan_to_num(0)).abs()
    return bool((spread.masked_fill(~finite, 0) < 1e-4 * (1 + e[finite].abs().amax())).all())


def _blocks_in_one_product(st: Structure, tokens: int) -> str | None:
    """Attention on blocks of the tokens computed in one product over all of them, scores
    ``(..., blocks, queries, keys)`` (Samba's chunked window: each block of queries with
    its own block's keys and the previous block's), which the reference does not model:
    what it is, with its line; None otherwise."""
    score = st.cores[0].score if len(st.cores) == 1 else None
    if score is None or score.output.dim() < 5:
        return None
    blocks, n = score.output.shape[-3], score.output.shape[-2]
    if not 1 < n < tokens <= blocks * n:
        return None
    where = f" at {score.location}" if score.location else ""
    return (
        f"not supported yet: attention computed on blocks of the tokens ({blocks} blocks of "
        f"{n} queries in one product: chunked local or block attention){where}"
    )


def _settings(holder: object) -> dict:
    """A layer's or configuration's settings by name: its attributes and, for a plain
    settings class, those its class declares (``class Args: sliding_window = 8``)."""
    out: dict = {}
    if not isinstance(holder, nn.Module):
        for k, v in vars(type(holder)).items():
            if not k.startswith("_") and not callable(v):
                out[k] = v
    out.update({k: v for k, v in getattr(holder, "__dict__", {}).items() if not k.startswith("_")})
    return out


def _token_blocks(st: Structure, tokens: int) -> tuple[str, str | None] | None:
    """Attention computed on blocks of a sequence's tokens, a computation for each
    (TRELLIS's windows, block-sparse attention: each query sees only the keys of its
    block), as what the reference does not model, with its line; None otherwise. Loops
    over heads, sequences or requests compute on all of a sequence's tokens each."""
    made = [c.fused or c.context or c.score for c in st.cores]
    sizes = [op.output.shape[-2] for op in made if op is not None and op.output.dim() >= 2]
    if len(sizes) < 2 or len(sizes) != len(st.cores) or max(sizes) >= tokens:
        return None
    if max(sizes) == 1:
        return None  # one query at a time (the book's loop over queries): not blocks
    where = made[0].location
    return (
        f"attention computed separately on blocks of the tokens ({len(sizes)} computations "
        f"of {min(sizes)} to {max(sizes)} of {tokens} tokens: windowed or block attention, "
        "each query seeing only the keys of its block?)",
        where,
    )


def _context_norm(rec: Recorder, st: Structure) -> ContextNorm | None:
    """The norm between the merged context and the output projection of ``st``: its
    input is a tensor the norm's first op was made from, as wide as the projection reads
    (the nearest first); its output, what the projection read."""
    ops, graph = rec.ops, Graph(rec)
    at, u_node = st.out_norm[0], st.out.input_node
    d = st.out.w.shape[0]
    u = ops[u_node].output
    if u.shape[-1] != d:
        return None
    u = u.detach().double().reshape(-1, d)
    # from the context on (the attention's own product or fused call)
    made = [c.context or c.fused for c in st.cores]
    start = max((op.index for op in made if op is not None), default=0)
    before = sorted((i for i in graph.ancestors(at) - {at} if i >= start), reverse=True)
    inputs = [
        ops[i].output.detach().double().reshape(-1, d)
        for i in before
        if ops[i].output.numel() == u.numel() and ops[i].output.shape[-1] == d
    ]
    lo = min(before, default=at)
    path = [ops[i] for i in sorted(graph.ancestors(u_node)) if i >= lo and ops[i].leaf is None]
    gains = gains_on_path(ops, graph, path, {d})
    return read_context_norm(inputs, u, gains, eps_on_path(ops, path))


def _batch_first(t: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as ``given`` ``(B, S, d)`` where the layer holds it sequence first
    ``(S, B, d)`` (Megatron-style code transposes the second sequence before the layer)."""
    if (
        t.dim() == given.dim() == 3
        and t.shape[:-1] != given.shape[:-1]
        and t.shape[:-1] == given.shape[:-1][::-1]
    ):
        return t.transpose(0, 1)
    return t


def _whole(rec: Recorder, graph: Graph, node: int, numel: int) -> torch.Tensor:
    """The scores' operand, or where it is one sequence's slice (a loop over the sequences
    of a flattened batch), the whole tensor it was cut from: up through layout ops until
    it holds ``numel`` entries (every sequence and head)."""
    i = node
    for _ in range(8):
        op = rec.ops[i]
        if op.output.numel() >= numel or op.name not in LAYOUT_OPS:
            break
        parents = graph.tainted_args(op)
        if len(parents) != 1:
            break
        i = parents[0]
    found = rec.ops[i].output
    return (found if found.numel() == numel else rec.ops[node].output).detach()


def _per_core(
    rec: Recorder, graph: Graph, cores: list, role: str, numel: int, piece: torch.Tensor
) -> torch.Tensor:
    """The operands of every core stacked, where one core's holds ``numel / cores`` entries:
    each sequence run apart (llama.cpp's one ubatch per sequence, a per-request loop), its
    rotation made apart too, so no one tensor holds the whole batch's. ``piece`` otherwise."""
    if len(cores) < 2 or numel % len(cores):
        return piece
    attr = "q_node" if role == "q" else "k_node"
    pieces = [_whole(rec, graph, getattr(c, attr), numel // len(cores)) for c in cores]
    if any(p.shape != pieces[0].shape for p in pieces) or pieces[0].numel() * len(cores) != numel:
        return piece
    return torch.stack(pieces)


def _written_slots(keys: torch.Tensor, seen: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """Keys read back from a static cache (``(..., slots, ...)``), cut to the slots some
    query sees where those are as many as the tokens (the rest, unwritten, hidden by the
    mask); as they are otherwise."""
    if seen is None or int(seen.sum()) != tokens:
        return keys
    axes = [i for i, size in enumerate(keys.shape) if size == seen.numel()]
    if len(axes) != 1:
        return keys
    return keys.index_select(axes[0], seen.nonzero().flatten())


class _Exited(_Captured):
    """The output of attention computed inline in a block, taken (see ``ModuleProbe.exit``)."""


class _TakeAt(TorchFunctionMode):
    """Takes the output of the call that applies an output projection held as bare
    parameters (``F.linear(ctx, self.w_o)``, ``ctx @ self.w_o.T``, then ``+ self.b_o``):
    the first call that reads a tensor made from the weights alone together with another
    tensor, and its bias add where the call did not take the bias."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor]):
        super().__init__()
        self.weights, self.biases = weights, biases

    def fresh(self) -> _TakeAt:
        return _TakeAt(self.weights, self.biases)

    def __enter__(self):
        self.derived = {id(w): w for w in self.weights}  # kept alive: ids stay theirs
        self.bias_ids = {id(b) for b in self.biases}
        self.taken = None
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        ids = {id(t) for t in [*tensors_in(args), *tensors_in(kwargs)]}
        if not ids or not isinstance(result, torch.Tensor):
            return result
        if self.taken is not None:
            if id(self.taken) in ids and ids & self.bias_ids:
                raise _Exited(result)
            return result
        if ids <= self.derived.keys():  # a view or transpose of the weight
            self.derived[id(result)] = result
        elif ids & self.derived.keys():
            if not self.bias_ids or ids & self.bias_ids:
                raise _Exited(result)
            self.taken = result
        return result


class _Entry:
    """Where a layer inside a wrapper takes its hidden states, and in which layout: batch
    first ``(B, T, d)``, tokens first ``(T, B, d)``, the tokens laid out as a grid
    ``(B, H, W, d)`` with ``H * W = T`` (``grid`` is then ``(H, W)``), the batch
    flattened to its tokens ``(B * T, d)`` (``flat``: vLLM-style runners, packed batches),
    or channels first ``(B, d, T)`` (``channels_first``: VITS / Glow-TTS, whose 1x1 Conv1d
    projections read the channels on axis 1; with ``ones`` axes of size one before the
    tokens, ``(B, d, 1, T)``: Apple's Neural Engine layout)."""

    def __init__(
        self,
        module: nn.Module,
        path: str,
        positions: list,
        tokens_first: bool,
        grid=None,
        flat: bool = False,
        channels_first: bool = False,
        ones: int = 0,
    ):
        self.module, self.path = module, path
        self.positions, self.tokens_first, self.grid = positions, tokens_first, grid
        self.flat, self.channels_first = flat, channels_first
        #: axes of size one between the channels and the tokens (``(B, d, 1, T)``)
        self.ones = ones
        #: the other float tensors the wrapper hands the layer, by argument (a mask, a
        #: position bias), as handed on the discovery run
        self.extras: dict = {}
        #: arguments handed as zeros: a residual the layer adds to its own output (BLOOM's
        #: ``residual``), so that what it returns is the attention's output
        self.zeroed: set = set()
        self._entered: tuple[torch.Tensor, torch.Tensor] | None = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The probe ``(B, T, d)`` in the layout the layer takes (the same tensor for the
        same probe: a recorder that knows it knows what the layer is handed)."""
        if self._entered is not None and self._entered[0] is x:
            return self._entered[1]
        sub = x
        if self.tokens_first:
            sub = x.transpose(0, 1)
        elif self.grid is not None:
            sub = x.reshape(x.shape[0], *self.grid, x.shape[-1])
        elif self.flat:
            sub = x.reshape(-1, x.shape[-1])
        elif self.channels_first:
            sub = x.transpose(1, 2)
            for _ in range(self.ones):
                sub = sub.unsqueeze(2)
        self._entered = (x, sub)
        return sub

    def handed(self, sub: torch.Tensor, args: tuple, kwargs: dict, change=None):
        """The layer's ``(args, kwargs)`` with the probe ``sub`` where its hidden states go,
        and ``change`` (``(argument, fn)``) applied to another of them."""
        args = tuple(sub if i in self.positions else a for i, a in enumerate(args))
        kwargs = {k: sub if k in self.positions else v for k, v in kwargs.items()}
        if self.zeroed:
            args = tuple(torch.zeros_like(a) if i in self.zeroed else a for i, a in enumerate(args))
            kwargs = {k: torch.zeros_like(v) if k in self.zeroed else v for k, v in kwargs.items()}
        if change is not None:
            key, fn = change
            args = tuple(fn(a) if i == key else a for i, a in enumerate(args))
            kwargs = {k: fn(v) if k == key else v for k, v in kwargs.items()}
        return args, kwargs

    def leave(self, out: torch.Tensor, b: int, n: int) -> torch.Tensor:
        """The layer's output back in ``(B, T, d)``."""
        if self.tokens_first and out.dim() == 3:
            return out.transpose(0, 1)
        if (
            self.channels_first
            and out.dim() == 3 + self.ones
            and out.shape[0] == b
            and out.shape[-1] == n
        ):
            return out.reshape(b, out.shape[1], n).transpose(1, 2)
        if self.flat and out.dim() == 2 and out.shape[0] == b * n:
            return out.reshape(b, n, out.shape[-1])
        if self.grid is not None and out.shape[0] == b and math.prod(out.shape[1:-1]) == n:
            return out.reshape(b, n, out.shape[-1])
        return out

    @property
    def as_given(self) -> bool:
        """The layer takes the probe ``(B, T, d)`` as it is (no layout to put it in)."""
        return not (self.tokens_first or self.flat or self.channels_first or self.grid is not None)


#: the scale source of the unscaled reading of a layer with a learned relative bias
_T5 = "no scale (T5's convention beside a learned relative bias)"


def _bias_word(bias: Alibi | LearnedBias | None) -> str | None:
    """The contract's word for a position bias."""
    if bias is None:
        return None
    return "learned" if isinstance(bias, LearnedBias) else "alibi"


class ModuleProbe:
    """Everything about calling one module; :meth:`run` hands the calls to a :class:`Judge`."""

    def __init__(self, tgt: Target, kind, seed, timeout, weights, tokens=None, host=None):
        self.tgt, self.timeout, self.weights = tgt, timeout, weights
        #: a model around the layer (:class:`.model.ModelHost`): the layer is run where it
        #: sits in it, and only its own computation is recorded
        self.host = host
        #: the model's layer raises called on its own (a context the model's forward sets
        #: up around it): it is run inside a forward of the whole model instead
        self._inside_model = False
        self.kind = None if kind is None else Kind.of(kind)
        self.fixed_tokens = tokens
        self.module: nn.Module = tgt.obj
        self.notes: list[str] = list(tgt.notes)
        self.kind_reason = ""
        self.causal_hint = False
        self.gen = torch.Generator().manual_seed(seed)
        # discovery draws from its own generator: the judged probes do not depend on it
        self.discovery_gen = torch.Generator().manual_seed(seed + 1)
        self._window_gen = torch.Generator().manual_seed(seed + 2)
        self._discovered_batched = True
        self.entry: _Entry | None = None
        #: attention computed inline in a block (no module of its own): the submodule that
        #: makes its output (the output projection), where the attention's output is taken
        self.exit: nn.Module | _TakeAt | None = None
        self.structure: Structure | None = None
        self._hf_rotary: nn.Module | None = None
        self._hf_layer_type: str | None = None
        self._rope_probe: list[Call] | None = None
        self._discovery_tokens = 0  # the tokens of the call the structure was read from
        self.cross = False  # keys and values from another sequence (a second input)
        self._second_read = False
        self._context_width = 0
        self._contexts: dict[tuple, torch.Tensor] = {}
        #: a model's cross-attention layer: the argument the model hands its other sequence
        #: in (position or keyword)
        self._cross_key = None
        #: a model's layer handed another sequence, named as one, that it does not read
        self._unread_context = None
        self._root_inputs: dict[tuple, torch.Tensor] = {}
        self._root_width = _WEIGHTLESS_WIDTH
        self._cache: dict = {}
        #: (which, factor, line) of each constant read as a muP multiplier (part of the
        #: scale); with ``plain_factors`` none is (the layer's siblings in a model carry none)
        self.multipliers: list[tuple[str, float, str | None]] = []
        self.plain_factors = False
        self._leaf_names = {id(p): f"param:{n}" for n, p in self.module.named_parameters()}
        self._leaf_names.update({id(b): f"buffer:{n}" for n, b in self.module.named_buffers()})

    # ------------------------------------------------------------------ the run
    def run(self) -> CheckReport:
        self.module.eval()
        self.adapter = self._adapter(self.module)
        weightless = self.kind is not None and not self.kind.weighted and not self.kind.one_query
        if weightless or not any(True for _ in self.module.parameters()):
            return self._run_weightless()
        st = self._discover()
        self.structure = st
        chunked = _blocks_in_one_product(st, self._discovery_tokens)
        if chunked is not None:
            raise Unsupported(chunked)
        blocks = _token_blocks(st, self._discovery_tokens)
        if blocks is not None:
            st.unmodelled.append(blocks)
        self._look_for_window(st)
        if st.pre:
            what = ", ".join(dict.fromkeys(op.name for op in st.pre))
            self.notes.append(
                f"its projections read the input after {what} (at {st.pre[0].location}): "
                "the stages are checked from there"
            )
        layer = self.entry.module if self.entry is not None else self.module
        if self.weights:
            binding = bind_names(self.module, self.weights, st.heads)  # paths from the target
        else:
            binding = bind_structure(st, layer, self.module)
        self.binding = binding
        tokens = self._tokens(binding)
        self._mask_when_longer(st, binding.d_in, tokens)
        x = torch.randn(BATCH, tokens, binding.d_in, generator=self.gen)
        self.calls = self._probe(x)
        given = self.kind
        reads_two = self.cross or self._unread_context is not None
        if self.host is not None and (reads_two or (self.kind is not None and self.kind.cross)):
            # a model's --kind is its self-attention layers' (or, cross, its cross layers'):
            # this one's is read
            self.kind = None
        if self.kind is None or self.kind.cross:
            self._self_and_cross(x)
        if self.kind is None:
            self.kind, self.kind_reason = self._infer_kind(binding, st, tokens)
            if given is not None and given != self.kind:
                which = "cross-attention" if Kind.of(given).cross else "self-attention"
                self.kind_reason += f" (the model's kind, {given}, applies to its {which} layers)"
        else:
            self.kind_reason = "given (--kind, or kind= from Python)"
            if self.kind.cross and not self.cross:
                self._expect_second_sequence()
                self.calls = self._probe(x)
            if self.kind.causal and self.adapter["hf"]:
                self.calls = self._probe(x, causal_hint=True)  # the model's causal mask
        if self.kind.one_query:
            raise AttnScopeError(
                "--kind scores: expected a function f(inputs, query_index), got an nn.Module"
            )
        if not self.kind.weighted:
            return self._judge([(None, Spec(self.kind, binding.d_in, binding.d_in))])
        return self._judge(self._specs(binding))

    def _run_weightless(self) -> CheckReport:
        tokens = self._tokens(None)
        x = torch.randn(BATCH, tokens, _WEIGHTLESS_WIDTH, generator=self.gen)
        self.calls = self._probe(x)
        if self.kind is None:
            self.kind, self.kind_reason = Kind.of("simplified"), "it has no trainable weights"
        else:
            self.kind_reason = "given (--kind, or kind= from Python)"
        if self.kind.weighted or self.kind.one_query:
            raise AttnScopeError(
                f"--kind {self.kind}: expected query, key and value weights, but "
                f"{type(self.module).__name__} has no parameters"
            )
        return self._judge([(None, Spec(self.kind, _WEIGHTLESS_WIDTH, _WEIGHTLESS_WIDTH))])

    # ------------------------------------------------------------------ discovery
    def _widths(self) -> list[int]:
        """Input widths to try, from the parameters' shapes (first registered first)."""
        if isinstance(self.module, nn.MultiheadAttention):
            return [self.module.embed_dim]
        seen: list[int] = []
        for p in self.module.parameters():
            dims = (p.shape[1], p.shape[0]) if p.dim() == 2 else tuple(p.shape)
            for d in dims:
                if d > 1 and d not in seen:
                    seen.append(d)
        return seen[:8]

    def _discover(self) -> Structure:
        """Call the target on widths its parameters suggest until one runs; read the
        attention's structure from that call."""
        if self.host is not None:
            return self._discover_in_model()
        tokens = self._discovery_tokens = self._tokens(None)
        errors: list[str] = []
        widths = self._widths()
        # a second required input (cross-attention?): another sequence, of any width
        pair = self.adapter["pair"]
        others = widths if pair else [None]
        attempts = [(d, d2) for d in widths for d2 in others][:24]
        if self.adapter.get("optional_second"):
            # forward(x, context=None): a cross-attention layer may need its second input
            attempts += [(d, d2) for d in widths[:2] for d2 in widths[:4]]
        for d, d2 in attempts:
            if d2 is not None:
                self.adapter["pair"] = True
            batch = torch.randn(BATCH, tokens, d, generator=self.discovery_gen)
            for x in (batch, batch[0]):  # some take only (tokens, d)
                other = None
                if d2 is not None:
                    other = torch.randn(*x.shape[:-1], d2, generator=self.discovery_gen)
                rec = self._recorder(x) if other is None else self._recorder(x, other)
                with rec:
                    out, err = self._invoke_root(x, other=other)
                if err is not None:
                    errors.append(f"input {fmt_shape(x.shape)}: {err}")
                    continue
                try:
                    st = read_structure(rec, self.module)
                except AttnScopeError as exc:
                    again = type(exc)(f"{self.tgt.text}: {exc}")
                    if isinstance(exc, SeveralLayers) and other is not None and not pair:
                        # found with an optional second sequence handed in (a block or model
                        # whose cross layers need one): the model check hands it too
                        again.second = self._second_name()
                    raise again from None
                self._root_width = d
                self._discovered_batched = x is batch
                self.cross = st.cross is not None
                self._context_width = d2 if d2 is not None else d
                # read for its values, not only its shape: some call took it, and what it
                # made reaches the output (not a projection of it dropped on the way)
                second = {op.index for op in rec.ops if op.leaf == "input:1"}
                self._second_read = other is not None and any(
                    second & set(op.args) for op in rec.ops
                )
                end = rec.node_of(out) if isinstance(out, torch.Tensor) else None
                if self._second_read and end is not None:
                    self._second_read = "input:1" in Graph(rec).roots(end)
                if other is not None and not any(second & set(op.args) for op in rec.ops):
                    # a second sequence no op reads (keys made from the first by mistake)
                    # runs at any width: probe it at the first's, which its key and value
                    # weights take
                    self._context_width = d
                if st.weightless:
                    raise AttnScopeError(
                        f"{self.tgt.text}: its attention reads no projection weights; check it "
                        "as --kind simplified, or name its weights with --weights"
                    )
                if st.call is not None:
                    if other is not None and x is not batch:
                        other = torch.randn(*batch.shape[:-1], d2, generator=self.discovery_gen)
                    self.entry = self._entry(st, rec, batch, other)
                    self.notes.append(f"the attention layer checked is {st.layer!r}")
                    self.exit = self._block_exit(batch, other)
                    self._inherit_tokens_first()
                else:
                    self.exit = self._exit(st, rec, out)
                return st
        self.adapter["pair"] = pair
        if widths and errors:  # runs where nothing watches it? then it cannot be read
            x = torch.randn(BATCH, tokens, widths[0], generator=self.discovery_gen)
            out, err = self._invoke_root(x)
            if err is None:
                raise Unsupported(
                    f"{self.tgt.text}: not supported yet: it runs only on torch's fused fast "
                    "path, which attnscope cannot see into (while its ops are recorded it "
                    f"takes the Python path, and that raises: {errors[0]})"
                )
        extra = self._required_beyond_input()
        if extra and errors:
            raise Unsupported(
                f"{self.tgt.text}: not supported yet: its forward needs more than the hidden "
                f"states ({', '.join(extra)}: a KV cache, positions or a mask of its own?), "
                "which the checker cannot make; check the attention layer through a model or "
                "block that supplies them. Every probe raised: " + "; ".join(errors[:2])
            )
        raise AttnScopeError(f"{self.tgt.text} raised on every probe: " + "; ".join(errors[:3]))

    def _look_for_window(self, st: Structure) -> None:
        """A sliding window wider than the discovery probe hides nothing there: where none
        is declared or seen, one longer call (its mask built by the layer or its model) is
        read for one. What else that call shows is left to the probes that follow."""
        if st.window is not None or self.host is not None or self.cross:
            return
        if self._declared_window() is not None or self._declared_local() is not None:
            return
        limit = self._context_limit()
        n = _WINDOW_PROBE if limit is None else min(_WINDOW_PROBE, limit)
        if n <= self._tokens(None) + 2:
            return
        x = torch.randn(BATCH, n, self._root_width, generator=self._window_gen)
        if not self._discovered_batched:
            x = x[0]
        rec = self._recorder(x)
        try:
            with rec:
                _, err = self._invoke_root(x)
            long = None if err is not None else read_structure(rec, self.module)
        except Exception:  # a longer input it does not take: no window read
            return
        if long is not None and long.window is not None and long.layer == st.layer:
            st.window, st.local = long.window, long.local
            self.notes.append(
                f"a sliding window of {long.window[0]} keys read from a {n}-token call"
                + (f" (its mask at {long.window[1]})" if long.window[1] else "")
            )

    def _mask_when_longer(self, st: Structure, d_in: int, tokens: int) -> None:
        """A mask read as causal (or a window) at the probe's length may be a pattern that
        only shows on longer inputs (Llama 4's chunked attention is causal within chunks of
        a few tokens): the mask is read once more on a longer input, and a pattern the
        checker does not model there is refused."""
        declared = self.kind is not None and self.kind.causal
        if self.fixed_tokens is not None or self.cross or (st.causal is None and not declared):
            return  # (no mask at this length in a layer given as causal: one may show later)
        if st.causal is not None and st.causal.startswith("is_causal"):
            return  # the kernel's own causal mask: the same at every length
        limit = self._context_limit()
        longer = min(4 * tokens + 5, 40) if limit is None else min(4 * tokens + 5, 40, limit)
        if longer <= tokens + 1:
            return
        gen = torch.Generator().manual_seed(len(self.tgt.text) + longer)
        x = torch.randn(BATCH, longer, d_in, generator=gen)
        rec = self._recorder(x)
        with rec:
            _, err = self._invoke(x)
        if err is not None:
            return
        try:
            read_structure(rec, self.module)
        except Unsupported as exc:
            seen = st.causal.split(" (")[0] if st.causal is not None else "no mask"
            raise Unsupported(
                f"{self.tgt.text}: {exc} (its mask, read as {seen} at {tokens} tokens, shows "
                f"this at {longer})"
            ) from None
        except AttnScopeError:
            return

    def _inherit_tokens_first(self) -> None:
        """A layer that says it takes ``(tokens, batch, d)`` (see :func:`_says_tokens_first`)
        and is handed its wrapper's input in the layout the wrapper got it: the wrapper
        works tokens first too (a fairseq encoder layer around its attention)."""
        e = self.entry
        if e is None or not e.as_given or self.adapter["seq_first"]:
            return
        try:
            params = [
                p
                for p in inspect.signature(e.module.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            return
        if _says_tokens_first(e.module, params):
            self.adapter["seq_first"] = True
            e.tokens_first = True
            self.notes.append(
                f"{e.path!r} says it takes (tokens, batch, d), and is handed its wrapper's "
                "input as it comes: both are called tokens first"
            )

    def _block_exit(self, x: torch.Tensor, other: torch.Tensor | None):
        """:meth:`_exit` for the layer found inside a wrapper (its module's own forward holds
        the attention and goes on past it: Molmo's blocks), read on one more recorded run
        of the wrapper, the layer's output taken from its module's call."""
        e, got = self.entry, {}

        def keep(mod, args, out):
            got.setdefault("out", first_tensor(out))

        handle = e.module.register_forward_hook(keep)
        # a cross block's second sequence recorded as an input too: its keys are made from it
        rec = self._recorder(x) if other is None else self._recorder(x, other)
        try:
            with rec:
                _, err = self._invoke_root(x, other=other)
        finally:
            handle.remove()
        if err is not None or "out" not in got:
            return None
        try:
            st = read_structure(rec, self.module)
        except AttnScopeError:
            return None
        if st.call is None or st.call.module is not e.module:
            return None
        return self._exit(st, rec, got["out"], within=st.call)

    def _exit(self, st: Structure, rec: Recorder, out, within=None) -> nn.Module | None:
        """Attention computed in the target's own forward (a method of a block, no module of
        its own) whose output then goes on (a residual, an MLP): the submodule that makes
        the attention's output, its output projection, or None where the target returns it.

        Only where what follows reads the target's input again past the output projection
        (a residual: the target is a block); a layer that only drops out or scales its
        projected output keeps that as its own. ``within``: the call of the layer's module
        inside a wrapper, whose input is whatever the wrapper made before it."""
        if st.out is None or not isinstance(out, torch.Tensor):
            return None
        end = st.out.op.index
        node = rec.node_of(out)
        if node is None or node == end or rec.ops[end].output.shape != out.shape:
            return None
        start, stop = (within.start, within.end) if within is not None else (0, len(rec.ops))
        # the input reached around the attention: not through the output projection, nor
        # through any core (heads computed apart, their projected outputs summed, are not)
        cores = {op.index for c in st.cores for op in (c.score, c.context, c.fused) if op}
        past = Graph(rec).ancestors(node, stop={end} | cores)
        residual = any(
            rec.ops[i].leaf == "input:0" or (within is not None and i < start)
            for i in past
            if i != end
        )
        # a block: its input normed before the projections (pre-norm), or weights of its own
        # after the attention (an MLP, a norm); a layer that adds its input to its own
        # output and stops there is a layer with a residual inside (a mistake)
        more = any(
            c.path and end < c.start < stop and any(True for _ in c.module.parameters())
            for c in rec.modules
        ) or any((op.leaf or "").startswith("param:") for op in rec.ops[end + 1 : stop])
        normed = any(op.index >= start for op in st.pre)  # its own pre-norm, not a wrapper's
        if end not in past or not residual or not (normed or more):
            return None
        # the innermost submodule call that holds the output projection and ends with it,
        # else the projection's own parameters, where the call that reads them is taken
        calls = sorted(
            (c for c in rec.modules if c.path and c.start <= end < c.end),
            key=lambda c: -c.depth,
        )
        if calls and calls[0].end - 1 == end:
            where, exit_ = repr(calls[0].path), calls[0].module
        else:
            params = dict(self.module.named_parameters())
            found = [params[n] for n in st.out.params if n in params]
            weights = [t for t in found if t.dim() == 2]
            if not weights:
                return None
            where = f"the call that applies {', '.join(st.out.params)}"
            exit_ = _TakeAt(weights, [t for t in found if t.dim() == 1])
        self.notes.append(
            "its attention is computed in its own forward, and what follows it (a residual, "
            f"more layers) is not checked: the attention's output is taken at {where}"
        )
        return exit_

    def _required_beyond_input(self) -> list[str]:
        """Required forward arguments after the first that are not another sequence: a
        cache, positions or a mask of the layer's own. A tensor-typed (or unannotated)
        second or third argument is taken for a sequence (cross-attention's context,
        ``(query, key, value)``), unless its name says cache, past, position or mask."""
        try:
            sig = inspect.signature(self.module.forward)
        except (TypeError, ValueError):
            return []
        required = [
            p
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ][1:]
        hints = ("cache", "past", "pos", "mask", "offset", "freqs", "rope", "cos", "sin")

        def a_sequence(p) -> bool:
            ann = p.annotation
            if isinstance(ann, str):
                typed = ann.split(".")[-1] in ("Tensor", "FloatTensor", "empty")
            else:
                typed = ann is p.empty or ann is torch.Tensor
            return typed and not any(h in p.name.lower() for h in hints)

        if len(required) <= 2 and not self.adapter["hf"] and all(map(a_sequence, required)):
            return []
        return [p.name for p in required]

    def _recorder(self, x: torch.Tensor, *more: torch.Tensor) -> Recorder:
        leaves = dict(self._leaf_names)
        for i, t in enumerate((x, *more)):
            leaves[id(t)] = f"input:{i}"
        scope = self.module if self.host is not None else None
        if scope is not None and self.entry is not None and x.dim() == 3:
            # a model's layer records only its own calls: the probe as the layer takes it
            # (tokens first: a transpose made outside) is the input it reads
            leaves[id(self.entry.enter(x))] = "input:0"
            leaves.update(self._handed_learned(x.shape[0], x.shape[1]))
        return Recorder(leaves, self.module, scope=scope)

    def _handed_learned(self, b: int, n: int) -> dict[int, str]:
        """The tensors the model hands this layer for ``b`` sequences of ``n`` tokens that
        it made from its trainable parameters alone (a relative position bias made once for
        every layer: T5's, MPNet's), as leaves of the layer's record: what the layer makes
        from them is learned, as if made from its own parameters."""
        got = self.host.arguments(self.entry.module, b, n)
        if isinstance(got, str):
            return {}
        learned = self.host.learned_arguments(self.entry.module, b, n)
        args, kwargs = got
        # shaped as scores, token by token (another sequence made from the model's weights
        # and a buffer of data, Whisper's audio, is an input the layer reads, not a bias)
        return {
            id(a): f"param:{HANDED}{k}"
            for k, a in [*enumerate(args), *kwargs.items()]
            if k in learned and isinstance(a, torch.Tensor) and a.dim() >= 2
            if a.shape[-2:] == (n, n)
        }

    def _discover_in_model(self) -> Structure:
        """A layer of a model: where it takes its hidden states (found on a run of the
        model), then its structure from its own computation, run where it sits."""
        tokens = self._discovery_tokens = self._tokens(None)
        got = self.host.arguments(self.module, BATCH, tokens)
        if isinstance(got, str):
            raise AttnScopeError(f"{self.tgt.text}: the model raised before the layer: {got}")
        args, kwargs = got
        given = [*enumerate(args), *kwargs.items()]
        seen = [
            (i, a)
            for i, a in given
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2
        ][:1]
        if not seen:
            raise AttnScopeError(
                f"{self.tgt.text}: the model did not call this layer with hidden states"
            )
        value = seen[0][1]
        # the hidden states wherever the model hands the same tensor again (DistilBERT's
        # attention(query=x, key=x, value=x)): the probe enters at every one of them
        # (or an equal copy: ``attn(norm(x), norm(x))`` hands two tensors of one value)
        where = [
            i
            for i, a in given
            if a is value
            or (
                isinstance(a, torch.Tensor)
                and a.shape == value.shape
                and a.dtype == value.dtype
                and torch.equal(a, value)
            )
        ]
        lead = tuple(value.shape[:-1])
        # channels first, tokens last, axes of one between ((B, d, T), or Apple's Neural
        # Engine layout (B, d, 1, T) for its 1x1 Conv2d projections)
        first = (
            value.dim() >= 3
            and value.shape[0] == BATCH
            and value.shape[-1] == tokens
            and value.shape[1] != tokens
            and all(s == 1 for s in value.shape[2:-1])
        )
        width = value.shape[1] if first else value.shape[-1]
        self.entry = _Entry(
            self.module,
            self.host.path,
            where,
            lead == (tokens, BATCH),
            # an engine's flattened batch: (B * T, d), each sequence's tokens in turn
            flat=lead == (BATCH * tokens,),
            channels_first=first,
            ones=value.dim() - 3 if first else 0,
        )
        # what else the model hands it (a mask, a position bias), as handed
        self.entry.extras = {
            i: a.detach().clone()
            for i, a in given
            if i not in where
            and isinstance(a, torch.Tensor)
            and a.is_floating_point()
            and a.dim() >= 2
        }
        x = torch.randn(BATCH, tokens, width, generator=self.discovery_gen)
        self._handed_residuals(x, value.shape)
        # an unrecorded first call: whether the layer runs called on its own, or only
        # inside the model's forward (a record holds no half-run call)
        self._invoke_layer(x.clone())
        rec = self._recorder(x)
        with rec:
            out, err = self._invoke_layer(x)
        if err is not None:
            raise AttnScopeError(f"{self.tgt.text}: the layer raised where it sits: {err}")
        # the other sequences the model hands it (the encoder's output a decoder's
        # cross-attention reads), by argument
        others = {
            i: a
            for i, a in given
            if i not in where
            and isinstance(a, torch.Tensor)
            and a.is_floating_point()
            and a.dim() == 3
            and a.shape[0] == value.shape[0]
        }
        try:
            st = read_structure(rec, self.module)
        except Unsupported:
            raise
        except AttnScopeError:
            key = self._cross_argument(x, others)
            if key is None:
                raise
            return self._discover_cross_in_model(x, key)
        if others and st.cores and "input:0" not in Graph(rec).roots(st.cores[0].k_node):
            # keys made from something other than its hidden states (read by a fused call
            # whose operands come from another sequence the model hands it)
            key = self._cross_argument(x, others)
            if key is not None:
                return self._discover_cross_in_model(x, key)
        if others and st.cores:
            st.unmodelled += self._unmodelled_with_others(x, others, st)
        self._unread_context = self._unread_sequence_in_model(x, out, others)
        # a layer that goes on past its output projection (ALBERT's attention adds its input
        # and norms the sum): its output is taken at the projection
        e = self.entry
        if e.as_given:  # ``out`` is what it returned
            self.exit = self._exit(st, rec, out)
        return st

    def _read_with_others(self, x: torch.Tensor, others: dict):
        """The layer's structure on a call where the other sequences the model hands it are
        marked as inputs (``input:1``, ...): ``(record, marks, structure)``, the structure
        None where the call raised or nothing could be read."""
        marks = {id(a): f"input:{k + 1}" for k, a in enumerate(others.values())}
        rec = self._recorder(x)
        rec.leaves.update(marks)
        with rec:
            _, err = self._invoke_layer(x)
        try:
            st = read_structure(rec, self.module) if err is None else None
        except AttnScopeError:
            st = None
        return rec, marks, st

    def _unmodelled_with_others(self, x: torch.Tensor, others: dict, st: Structure) -> list:
        """What the layer computes that is not modelled and shows only once the other
        sequences the model hands it are known as inputs (keys made from its hidden states
        joined to a memory the model hands it: Transformer-XL's ``cat([mems, h])``)."""
        seen = self._read_with_others(x, others)[2]
        return [] if seen is None else [u for u in seen.unmodelled if u not in st.unmodelled]

    def _cross_argument(self, x: torch.Tensor, others: dict):
        """A model's layer with no attention read from its hidden states alone: the argument
        (position or keyword) whose sequence its keys and values read, where the sequences
        the model hands it beside them make one (a decoder's cross-attention reading the
        encoder's output); None where they make none."""
        if not others:
            return None
        rec, marks, st = self._read_with_others(x, others)
        if st is None or st.cross is None or not st.roles["k"]:
            return None
        g = Graph(rec)
        read = set().union(*(g.roots(p.input_node) for p in st.roles["k"] + st.roles["v"]))
        keys = [key for key, a in others.items() if marks[id(a)] in read]
        # one tensor the model hands at several arguments (``attention(x, enc, enc)``) is one
        # sequence: the first argument that holds it stands for it
        tensors = {id(others[key]) for key in keys}
        if len(tensors) != 1:
            raise Unsupported(
                f"{self.tgt.text}: not supported yet: cross-attention inside a model whose keys "
                f"and values read {len(tensors)} of the sequences the model hands it (at "
                f"{st.cross})"
            )
        return keys[0]

    def _discover_cross_in_model(self, x: torch.Tensor, key) -> Structure:
        """A model's cross-attention layer: from here on every probe of a size hands it, as
        its other sequence, the tensor the model hands that argument at that size (marked
        ``input:1`` in every record), and the reference reads it as the context."""
        self.cross = True
        self._cross_key = key
        ctx = self._context(x)
        self._context_width = ctx.shape[-1]
        self._second_read = True
        rec = self._recorder(x, ctx)
        with rec:
            _, err = self._invoke_layer(x)
        if err is not None:
            raise AttnScopeError(f"{self.tgt.text}: the layer raised where it sits: {err}")
        try:
            return read_structure(rec, self.module)
        except AttnScopeError as exc:
            raise type(exc)(f"{self.tgt.text}: {exc}") from None

    def _unread_sequence_in_model(self, x: torch.Tensor, out, others: dict):
        """A model's layer whose attention reads its hidden states alone, handed another
        sequence beside them that nothing it computes reads, where that argument's name says
        it is one (``xa``, ``encoder_hidden_states``): the computation cannot tell a
        cross-attention layer whose keys read the wrong input from self-attention with an
        idle argument, the name breaks the tie (as for a layer checked alone). The argument,
        or None."""
        if not isinstance(out, torch.Tensor):
            return None

        def nudge(t):
            return t + torch.randn(t.shape, generator=self.discovery_gen).to(t.dtype)

        for key in others:
            name = key if isinstance(key, str) else self._parameter_name(key)
            # named like one, or the very sequence the model requires beside its input
            # (a decoder's memory handed on as it came)
            handed = self.host.is_memory(others[key])
            if not handed and (name is None or not _names_a_sequence(name)):
                continue
            moved, err = self._invoke_layer(x, change=(key, nudge))
            unread = err is None and moved is not None and moved.shape == out.shape
            if unread and close(moved.double(), out.double(), rtol=1e-6):
                return key
        return None

    def _parameter_name(self, position: int) -> str | None:
        """The name of the layer's forward parameter at ``position`` (as the model calls it)."""
        m = self.entry.module if self.entry is not None else self.module
        try:
            params = [
                p
                for p in inspect.signature(m.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            return None
        return params[position].name if position < len(params) else None

    def _self_and_cross(self, x: torch.Tensor) -> None:
        """A target whose optional second input, handed another sequence, runs a second
        attention layer that reads it (a decoder block or decoder of vectors: self-attention,
        then cross-attention over the encoder's output) while the layer found reads none: a
        model of two kinds of layer, checked layer by layer with that sequence handed in
        (raises :class:`SeveralLayers`)."""
        if self.host is not None or self.cross:
            return
        required = self.adapter.get("pair")
        if not required and not self.adapter.get("optional_second"):
            return
        # an optional input runs it only where its name says it is another sequence
        name = None if required else self._second_name()
        if not required and name is None:
            return
        elsewhere = self._cross_elsewhere(x)
        if elsewhere is None:
            return
        exc = SeveralLayers(
            f"{self.tgt.text}: holds self-attention ({self.entry.path!r}) and, when handed "
            f"{name or 'its second sequence'}, cross-attention ({elsewhere!r}): checked as a "
            "model, layer by layer"
        )
        exc.second = name  # (one it requires is handed by the model check anyway)
        raise exc

    def _cross_elsewhere(self, x: torch.Tensor) -> str | None:
        """The path of another attention layer of the target that reads a second sequence,
        where the layer found (inside a wrapper) reads none: run once with one handed in."""
        if self.entry is None or self.host is not None:
            return None
        if not (self.adapter.get("optional_second") or self.adapter.get("pair")):
            return None
        ctx = torch.randn(
            *x.shape[:-2],
            x.shape[-2] + 3,
            self._context_width or x.shape[-1],
            generator=self.discovery_gen,
        )
        rec = self._recorder(x, ctx)
        pair = self.adapter.get("pair")
        self.adapter["pair"] = True
        try:
            with rec:
                _, err = self._invoke_root(x, other=ctx)
        finally:
            self.adapter["pair"] = pair
        if err is not None:
            return None
        cores = attention_cores(rec, self.module)
        g = Graph(rec)
        for core in cores:
            node = core.k_node if core.k_node is not None else core.v_node
            if node is not None and "input:1" in g.roots(node):
                layers = [c for c in rec.modules if c.path and c.start <= node < c.end]
                inner = max(layers, key=lambda c: c.depth, default=None)
                path = inner.path if inner is not None else ""
                if path != self.entry.path:
                    return path
        return None

    def _handed_residuals(self, x: torch.Tensor, shape: torch.Size) -> None:
        """Arguments the model hands a layer, shaped as its hidden states, that the layer adds
        to its own output as they are (BLOOM's attention takes the ``residual`` and returns
        ``dense(context) + residual``): read from what it computes (one more added to that
        argument moves every output by exactly one), and handed as zeros from then on."""
        e = self.entry
        base, err = self._invoke_layer(x)
        if err is not None or base is None:
            return
        for key, t in e.extras.items():
            if t.shape != shape:
                continue
            moved, err = self._invoke_layer(x, change=(key, lambda a: a + 1.0))
            if err is not None or moved is None or moved.shape != base.shape:
                continue
            if torch.allclose(moved - base, torch.ones_like(base), atol=1e-4):
                e.zeroed.add(key)
                self.notes.append(
                    f"argument {key!r} is a residual the model hands the layer, which adds it "
                    "to its output: it is handed zeros, so the output checked is the attention's"
                )

    def _entry(
        self, st: Structure, rec: Recorder, x: torch.Tensor, other: torch.Tensor | None = None
    ) -> _Entry:
        """How to put a probe into a layer inside a wrapper: the arguments that carry its
        hidden states (found by identity on a second, identical run) and their layout.
        ``other``: the second input discovery gave the wrapper (of its own width), given
        again."""
        node = st.input_node
        # the latest tensor made before the layer's call (or first seen inside it, a leaf)
        ancestors = Graph(rec).ancestors(node)
        before = [i for i in ancestors if i < st.call.start or rec.ops[i].leaf is not None]
        hidden = rec._alive[max(before)] if before else rec._alive[node]
        value = hidden.detach().clone()
        module = st.call.module
        positions: list = []

        extras: dict = {}

        def grab(mod, args, kwargs):
            for key, a in [*enumerate(args), *kwargs.items()]:
                if not isinstance(a, torch.Tensor):
                    continue
                if a.shape == value.shape and torch.equal(a, value):
                    positions.append(key)
                elif a.is_floating_point() and a.dim() >= 2:
                    extras[key] = a.detach().clone()
            raise _Captured(None)

        handle = module.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            self._invoke_root(x, other=other)
        except _Captured:
            pass
        finally:
            handle.remove()
        b, n = x.shape[:2]
        lead = tuple(value.shape[:-1])
        entry = None
        if positions and lead in ((b, n), (n, b)):
            entry = _Entry(module, st.layer, positions, lead == (n, b) and lead != (b, n))
        elif positions and value.dim() > 3 and lead[0] == b and math.prod(lead[1:]) == n:
            entry = _Entry(module, st.layer, positions, False, grid=lead[1:])
        elif positions and lead == (b * n,) and before and _batch_major(rec, max(before), b, n):
            # the batch flattened to its tokens, sequence after sequence
            entry = _Entry(module, st.layer, positions, False, flat=True)
        elif positions and value.dim() == 3 and value.shape[0] == b and value.shape[2] == n:
            # channels first, (B, d, T): the tokens on the last axis (VITS's 1x1 Conv1d)
            entry = _Entry(module, st.layer, positions, False, channels_first=True)
        if entry is not None:
            entry.extras = extras
            return entry
        raise AttnScopeError(
            f"{self.tgt.text}: found its attention in {st.layer!r}, which receives its input "
            f"as {describe(value)}; expected (batch, tokens, d), (tokens, batch, d), "
            "(batch, d, tokens) or a grid of the tokens (batch, h, w, d) passed as an argument"
        )

    # ------------------------------------------------------------------ calling
    def _adapter(self, m: nn.Module) -> dict:
        """How to call the target: f(x), f(x, x, x), tokens-first, or with an HF mask."""
        try:
            params = [
                p
                for p in inspect.signature(m.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            params = []
        required = [p for p in params if p.default is inspect.Parameter.empty]
        # tokens first, (T, B, d): torch's default, and any module that says so
        seq_first = getattr(m, "batch_first", True) is False or _says_tokens_first(m, params)
        hf = type(m).__module__.startswith("transformers") and any(
            p.name == "attention_mask" for p in params
        )
        names = [p.name for p in params]
        if hf:  # called as its model calls it: hidden states, then keywords
            return {
                "qkv": False,
                "pair": False,
                "seq_first": False,
                "hf": True,
                "hf_rope": "position_embeddings" in names,
                "hf_required": [p.name for p in required[1:]],
            }
        return {
            "qkv": len(required) >= 3,
            "pair": len(required) == 2,
            "optional_second": len(required) == 1 and len(params) >= 2,
            "seq_first": seq_first,
            "hf": hf,
            "hf_rope": False,
            "hf_required": [],
        }

    def _hf_model_inputs(self, x: torch.Tensor, required: list[str]) -> dict:
        """What a Hugging Face model hands its attention besides the hidden states: ALiBi's
        tensor from the model's own ``build_alibi_tensor`` (BLOOM), a zero residual for a
        layer that adds its own (its output is then the attention's)."""
        out: dict = {}
        module = sys.modules.get(type(self.module).__module__)
        b, n = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
        if "alibi" in required and hasattr(module, "build_alibi_tensor"):
            heads = getattr(self.module, "num_heads", None)
            if isinstance(heads, int):
                ones = torch.ones(b, n, dtype=torch.long)
                out["alibi"] = module.build_alibi_tensor(ones, heads, x.dtype)
        if "residual" in required:
            out["residual"] = torch.zeros_like(x)
        return out

    def _hf_position_embeddings(self, x: torch.Tensor):
        """``(cos, sin)`` for positions 0..n-1 from the model's own rotary class, built from
        the layer's config, as the model computes them before calling its layers."""
        if self._hf_rotary is None:
            m = self.module
            module = sys.modules[type(m).__module__]
            stem = type(m).__name__.removesuffix("Attention").removesuffix("DecoderLayer")
            names = [n for n in dir(module) if n.endswith("RotaryEmbedding")]
            names.sort(key=lambda n: n != f"{stem}RotaryEmbedding")
            # a decoder layer may keep its config only in its attention (Phi)
            config = getattr(m, "config", None) or next(
                (c for sub in m.modules() if (c := getattr(sub, "config", None)) is not None),
                None,
            )
            if not names or config is None:
                raise AttnScopeError(
                    f"{self.tgt.text}: takes position_embeddings, and no rotary embedding class "
                    "and config were found to make them"
                )
            self._hf_rotary = getattr(module, names[0])(config=config)
            self._hf_layer_type = self._rotary_layer_type(self._hf_rotary, config)
        b, n = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
        positions = torch.arange(n).unsqueeze(0).expand(b, n)
        more = () if self._hf_layer_type is None else (self._hf_layer_type,)
        made = self._hf_rotary(x if x.dim() == 3 else x.unsqueeze(0), positions, *more)
        if isinstance(made, torch.Tensor):  # one complex table (Llama 4's freqs_cis)
            return made if x.dim() == 3 else made[0]
        cos, sin = made
        return (cos, sin) if x.dim() == 3 else (cos[0], sin[0])

    def _rotary_layer_type(self, rotary: nn.Module, config) -> str | None:
        """The layer type a model's rotary class is asked for (Gemma 3 keeps tables per
        ``config.layer_types`` entry: local and global layers turn by other bases), for
        this layer's index; None where its forward takes no layer type."""
        try:
            if "layer_type" not in inspect.signature(rotary.forward).parameters:
                return None
        except (TypeError, ValueError):
            return None
        types = list(getattr(config, "layer_types", None) or [])
        idx = next(
            (
                i
                for sub in self.module.modules()
                if isinstance(i := getattr(sub, "layer_idx", None), int)
            ),
            0,
        )
        return types[idx] if 0 <= idx < len(types) else (types[0] if types else None)

    def _invoke(self, x32: torch.Tensor, causal_hint: bool = False):
        if self.entry is not None:
            return self._invoke_layer(x32, causal_hint)
        return self._invoke_root(x32, causal_hint)

    def _invoke_root(
        self,
        x32: torch.Tensor,
        causal_hint: bool = False,
        other: torch.Tensor | None = None,
        extra: dict | None = None,
    ):
        if self.host is not None:  # the model around the layer, on its own input
            return self.host.call(x32)
        a = self.adapter
        inp = x32
        batched = x32.dim() == 3
        if a["seq_first"] and batched:
            inp = x32.transpose(0, 1)
        kwargs: dict = {name: None for name in a["hf_required"]}
        if a["hf_rope"]:
            kwargs["position_embeddings"] = self._hf_position_embeddings(x32)
        kwargs.update(self._hf_model_inputs(x32, a["hf_required"]))
        # the model passes its mask always; a layer that requires one gets it from the start
        required_mask = "attention_mask" in a["hf_required"]
        if a["hf"] and (causal_hint or required_mask):
            n = x32.shape[-2]
            causal = causal_hint or getattr(self.module, "is_causal", False) is True
            hide = torch.ones(n, n, dtype=torch.bool).triu(1 if causal else n)
            window = self._declared_window()
            if window is not None:  # the model's own mask for a sliding-window layer
                hide = hide | torch.ones(n, n, dtype=torch.bool).tril(-window)
            mask = torch.zeros(n, n).masked_fill(hide, torch.finfo(torch.float32).min)
            kwargs["attention_mask"] = mask.expand(x32.shape[0] if batched else 1, 1, n, n)
        kwargs.update(extra or {})
        if a["qkv"]:
            args = (inp, inp, inp)
        elif a["pair"]:  # a second input: another sequence in discovery (cross-attention?)
            if other is None and self.cross:
                other = self._context(x32)
            elif other is None and self._context_width not in (0, x32.shape[-1]):
                # a second input of its own width that the attention does not read (yet):
                # one like discovery's, the input's tokens wide
                other = self._context(x32, same_length=True)
            args = (inp, inp if other is None else other)
        else:
            args = (inp,)
        # the exit of a layer inside a wrapper is taken by the caller (:meth:`_invoke_layer`)
        exiting = self._taking_exit() if self.entry is None else contextlib.nullcontext()
        try:
            with exiting:
                result, err = call_safely(self.module, *args, timeout=self.timeout, **kwargs)
        except _Exited as got:
            if self.entry is not None:
                raise
            result, err = got.output, None
        if err is not None:
            return None, err
        out = first_tensor(result)
        if not isinstance(out, torch.Tensor):
            raise AttnScopeError(
                f"{self.tgt.text}: expected the module to return a tensor (or a tuple whose first "
                f"element is one), got {describe(out)}"
            )
        if a["seq_first"] and batched and out.dim() == 3:
            out = out.transpose(0, 1)
        return out, None

    @contextlib.contextmanager
    def _taking_exit(self):
        """Where the attention is inline in a block (:meth:`_exit`), its output is taken at
        the exit: :class:`_Exited` is raised with it, and the block stops there."""
        if isinstance(self.exit, nn.Module):

            def leave(mod, args, out):
                raise _Exited(out)

            handle = self.exit.register_forward_hook(leave)
            try:
                yield
            finally:
                handle.remove()
        elif self.exit is not None:
            with self.exit.fresh():
                yield
        else:
            yield

    def _root_input(self, b: int, n: int) -> torch.Tensor:
        """The wrapper's own input for a probe of this size (the same every time)."""
        if self.host is not None:
            return self.host.input(b, n)
        if (b, n) not in self._root_inputs:
            d = self._root_width
            self._root_inputs[(b, n)] = torch.randn(b, n, d, generator=self.discovery_gen)
        return self._root_inputs[(b, n)]

    def _invoke_layer(self, x32: torch.Tensor, causal_hint: bool = False, change=None):
        """Run the wrapper; swap the layer's hidden states for ``x32`` on the way in, take its
        output on the way out (a Hugging Face wrapper gets the model's causal mask where
        ``causal_hint``, and hands it on). ``change``: ``(argument, fn)``, another of the
        layer's arguments replaced by ``fn`` of it on the way in."""
        e = self.entry
        if x32.dim() != 3:
            return None, "a layer inside a wrapper is probed with batched input only"
        sub = e.enter(x32)
        if self.host is not None:  # a model's layer: called on what the model hands it
            return self._invoke_in_model(sub, *x32.shape[:2], change)

        try:
            with self._swapped_in(sub, change), self._taking_exit():
                _, err = self._invoke_root(self._root_input(*x32.shape[:2]), causal_hint)
        except _Captured as got:
            out = first_tensor(got.output)
            if not isinstance(out, torch.Tensor):
                raise AttnScopeError(
                    f"{self.tgt.text}: expected {e.path!r} to return a tensor (or a tuple whose "
                    f"first element is one), got {describe(out)}"
                ) from None
            return e.leave(out, *x32.shape[:2]), None
        return None, err or f"{e.path!r} was not called"

    @contextlib.contextmanager
    def _swapped_in(self, sub: torch.Tensor, change=None):
        """While the wrapper or model around the layer runs: the layer's hidden states
        swapped for ``sub`` on the way in (and ``change``'s argument), its output taken on
        the way out (raised as :class:`_Captured`, which stops the run there)."""
        e = self.entry

        def swap(mod, args, kwargs):
            return e.handed(sub, args, kwargs, change)

        def take(mod, args, out):
            raise _Captured(out)

        hooks = [
            e.module.register_forward_pre_hook(swap, with_kwargs=True),
            e.module.register_forward_hook(take),
        ]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def _invoke_in_model(self, sub: torch.Tensor, b: int, n: int, change=None):
        """Call a model's layer on the arguments the model hands it for this size (captured
        once, on one run of the whole model), its hidden states swapped for ``sub`` (and
        ``change``, as :meth:`_invoke_layer`'s)."""
        e = self.entry
        got = self.host.arguments(e.module, b, n)
        if isinstance(got, str):
            return None, got
        if self._inside_model:
            within = self._within_model(sub, b, n, change)
            return within if within is not None else (None, f"{e.path!r} was not called")
        args, kwargs = e.handed(sub, *got, change)
        try:
            with self._taking_exit():
                result, err = call_safely(e.module, *args, timeout=self.timeout, **kwargs)
        except _Exited as taken:
            result, err = taken.output, None
        if err is not None:
            # called on its own, the layer lacks what the model's forward sets up around it
            # (nano-vllm's global context of sequence lengths): from now on it runs inside
            # the model (the discovery's unrecorded first call finds this out)
            within = self._within_model(sub, b, n, change)
            if within is not None:
                self._inside_model = True
            return within if within is not None else (None, err)
        out = first_tensor(result)
        if not isinstance(out, torch.Tensor):
            raise AttnScopeError(
                f"{self.tgt.text}: expected {e.path!r} to return a tensor (or a tuple whose "
                f"first element is one), got {describe(out)}"
            )
        return e.leave(out, b, n), None

    def _within_model(self, sub: torch.Tensor, b: int, n: int, change=None):
        """The layer's output for ``sub``, run where it sits in a forward of the whole model
        (on its input for this size): its hidden states swapped on the way in, its output
        taken on the way out (the model stops there); None where that fails too."""
        try:
            with self._swapped_in(sub, change), self._taking_exit():
                self.host.call(self.host.input(b, n))
        except _Captured as got:
            out = first_tensor(got.output)
            if isinstance(out, torch.Tensor):
                return self.entry.leave(out, b, n), None
        return None

    def _expect_second_sequence(self) -> None:
        """A layer checked as cross-attention whose keys and values do not read its second
        input: probe it with one all the same (the reference reads it; the layer's output
        then shows the mistake)."""
        if self.host is not None:  # a model's layer: the sequence the model hands it
            if self._unread_context is None and self._cross_key is None:
                raise AttnScopeError(
                    f"{self.tgt.text}: --kind cross: expected a layer the model hands a second "
                    "sequence, got one handed only its hidden states"
                )
            self._cross_key = self._cross_key if self.cross else self._unread_context
            self.cross = True
            self._context_width = self._context(self.calls[0].given.float()).shape[-1]
            return
        if self.adapter.get("optional_second"):  # forward(x, encoder_hidden_states=None)
            self.adapter["pair"] = True
        if not self.adapter["pair"]:
            raise AttnScopeError(
                f"{self.tgt.text}: --kind cross: expected a layer that takes a second sequence "
                "(forward(x, context)), got one that takes only its input"
            )
        self.cross = True
        self._context_width = self._context_width or self._root_width
        self._entry_without_context()

    def _entry_without_context(self) -> None:
        """A wrapper whose layer was found handed its hidden states in two places (a block
        that, handed no second sequence, passes its normed input as both: Chatterbox's
        ``x2_norm = x1_norm if x2 is None``), now checked with the other sequence handed:
        the places that then carry what is made from it are no hidden states."""
        e = self.entry
        if e is None or len(e.positions) < 2:
            return
        x = self._root_input(BATCH, 7)
        ctx = self._context(x)
        seen: list[dict] = []

        def grab(mod, args, kwargs):
            seen.append({k: a for k, a in [*enumerate(args), *kwargs.items()] if k in e.positions})
            raise _Captured(None)

        handle = e.module.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            for other in (ctx, ctx * 2.0 + 1.0):
                with contextlib.suppress(_Captured):
                    self._invoke_root(x, other=other)
        finally:
            handle.remove()
        if len(seen) != 2:
            return
        same = [
            k
            for k in e.positions
            if isinstance(seen[0].get(k), torch.Tensor)
            and isinstance(seen[1].get(k), torch.Tensor)
            and seen[0][k].shape == seen[1][k].shape
            and torch.equal(seen[0][k], seen[1][k])
        ]
        if same and len(same) < len(e.positions):
            e.positions = same

    def _context(self, x: torch.Tensor, same_length: bool = False) -> torch.Tensor:
        """Cross-attention's other sequence for a call on ``x``: three tokens longer than
        ``x`` (a key/value read from the wrong input then shows; ``same_length``: as long),
        the same for every call of that size. A model's layer gets the one the model hands
        it at that size (the encoder's output), the very tensor the layer is then called
        with, so that a recorder that knows it sees the keys read it."""
        if self.host is not None and self._cross_key is not None:
            got = self.host.arguments(self.entry.module, *x.shape[:2])
            if isinstance(got, str):
                raise AttnScopeError(f"{self.tgt.text}: the model raised before the layer: {got}")
            args, kwargs = got
            k = self._cross_key
            ctx = args[k] if isinstance(k, int) and k < len(args) else kwargs.get(k)
            if not isinstance(ctx, torch.Tensor):
                raise AttnScopeError(
                    f"{self.tgt.text}: the model did not hand the layer its other sequence "
                    f"({k!r}) for {fmt_shape(x.shape[:2])} tokens"
                )
            return ctx
        key = (*x.shape[:-1], same_length)
        if key not in self._contexts:
            extra = 0 if same_length else 3
            shape = (*x.shape[:-2], x.shape[-2] + extra, self._context_width)
            self._contexts[key] = torch.randn(*shape, generator=self.discovery_gen)
        return self._contexts[key]

    def _cross_inputs(self, rec: Recorder, ctx: torch.Tensor | None):
        """``(context, kv_own)`` of a call (see :meth:`_kv_input`, :meth:`_kv_own`), its
        structure read once; ``(None, None)`` for self-attention."""
        if ctx is None:
            return None, None
        try:
            st = read_structure(rec, self.module)
        except AttnScopeError:
            st = None
        return self._kv_input(rec, ctx, st), self._kv_own(rec, ctx, st)

    def _kv_input(self, rec: Recorder, ctx: torch.Tensor, st: Structure | None) -> torch.Tensor:
        """Cross-attention's context for the reference, ``(B, S, d)`` float64: what its
        key/value projections read where that is made from the second sequence alone (a
        wrapper may norm it first), each sequence's where the layer hands it to another
        sequence's queries (see :meth:`_batch_order`), else the second sequence as given
        (keys read from the wrong input: the reference still reads the right one)."""
        batched = ctx.dim() == 3
        given = ctx.detach().to(torch.float64)
        if st is not None and st.roles["k"]:
            g = Graph(rec)
            node = st.roles["k"][0].input_node
            if node is not None and g.roots(node) == {"input:1"}:
                t = _batch_first(rec.ops[node].output.detach().to(torch.float64), given)
                if t.shape[:-1] == given.shape[:-1]:
                    order = self._batch_order(rec, node) if batched else None
                    given = t if order is None else t[order]
            elif st.call is not None:
                # keys not read from it: the second sequence as the wrapper made it for the
                # layer (Parler-TTS projects it first), the last such before the layer's call
                width = st.roles["k"][0].w.shape[0]
                for op in reversed(rec.ops[: st.call.start]):
                    t = op.output
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        t = _batch_first(t, given)
                    if (
                        isinstance(t, torch.Tensor)
                        and t.is_floating_point()
                        and t.shape[:-1] == given.shape[:-1]
                        and t.shape[-1] == width
                        and g.roots(op.index) == {"input:1"}
                    ):
                        given = t.detach().to(torch.float64)
                        break
        return given if batched else given.unsqueeze(0)

    def _batch_order(self, rec: Recorder, node: int) -> list[int] | None:
        """Where the layer's key/value input (op ``node`` of ``rec``) puts each sequence's
        context: ``order[b]``, the row made from sequence ``b``'s, where an op on the way
        from the second input reorders the batch (``memory.flip(0)`` inside the layer: each
        sequence's queries read another sequence's memory, ``batch_mixing``); None where
        none does. Read on the recorded tensors: an op whose output rows are its input's
        rows in another order."""
        g = Graph(rec)
        order = None
        for i in sorted(g.ancestors(node) | {node}):
            op = rec.ops[i]
            if not op.args or g.roots(i) != {"input:1"}:
                continue
            out, src = op.output, rec.ops[op.args[0]].output
            if not isinstance(out, torch.Tensor) or out.shape != src.shape or out.dim() < 2:
                continue
            if out.shape[0] < 2 or torch.equal(out, src):
                continue
            rows = [
                next((j for j in range(src.shape[0]) if torch.equal(out[r], src[j])), None)
                for r in range(out.shape[0])
            ]
            if None in rows or sorted(rows) != list(range(out.shape[0])):
                continue
            # out[r] is src[rows[r]]: sequence b's row is where rows[r] == b
            here = [rows.index(b) for b in range(len(rows))]
            order = here if order is None else [here[j] for j in order]
        if order is None or order == list(range(len(order))):
            return None
        return order

    def _kv_own(
        self, rec: Recorder, ctx: torch.Tensor, st: Structure | None
    ) -> torch.Tensor | None:
        """Cross-attention whose key projections read a transform of the queries' input
        alone, not what the query projection reads (``norm(q)`` handed where
        ``norm(context)`` belongs): that tensor, ``(B, T, d)`` float64, for the
        ``wrong_source`` reading; else None."""
        if st is None or not st.roles["k"] or not st.roles["q"]:
            return None
        node, q_node = st.roles["k"][0].input_node, st.roles["q"][0].input_node
        if node is None or q_node is None or node == q_node or "input:1" in Graph(rec).roots(node):
            return None
        # the queries' sequence (inside a wrapper, its own hidden states: the probe is
        # swapped in for the layer's queries alone), as many tokens as the queries read
        t, q = rec.ops[node].output, rec.ops[q_node].output
        if t.shape[:-1] != q.shape[:-1]:
            return None
        t = t.detach().to(torch.float64)
        return t if ctx.dim() == 3 else t.unsqueeze(0)

    def _probe(self, x: torch.Tensor, causal_hint: bool = False) -> list[Call]:
        """Call batched, then each sequence alone; keep every call that works."""
        self.causal_hint = causal_hint
        calls: list[Call] = []
        errors = []
        ctx = self._context(x) if self.cross else None
        rec = self._recorder(x) if ctx is None else self._recorder(x, ctx)
        with rec:
            out, err = self._invoke(x, causal_hint)
        if err is None:
            self._expect_shape(out, x)
            calls.append(
                Call(
                    self._ref_x(rec, x),
                    out.double(),
                    True,
                    rec.ops,
                    rebuild_sdpa(rec),
                    rec.sdpa,
                    x.double(),
                    rec,
                    *self._cross_inputs(rec, ctx),
                )
            )
        else:
            errors.append(f"batched input {fmt_shape(x.shape)}: {err}")
        if self.entry is None:
            x1 = x[0]
            ctx1 = self._context(x1) if self.cross else None
            rec1 = self._recorder(x1) if ctx1 is None else self._recorder(x1, ctx1)
            with rec1:
                out1, err1 = self._invoke(x1, causal_hint)
            if err1 is None and not self._shape_ok(out1, x1):
                # (tokens, d) read as a batch of tokens: say so, and go on batched
                err1 = f"it returns {describe(out1)}, not one row per token"
            if err1 is None:
                calls.append(
                    Call(
                        self._ref_x(rec1, x1).unsqueeze(0),
                        out1.double().unsqueeze(0),
                        False,
                        rec1.ops,
                        rebuild_sdpa(rec1),
                        rec1.sdpa,
                        x[:1].double(),
                        rec1,
                        *self._cross_inputs(rec1, ctx1),
                    )
                )
            else:
                errors.append(f"unbatched input {fmt_shape(x1.shape)}: {err1}")
        if not calls:
            raise AttnScopeError(f"{self.tgt.text} raised on every probe: " + "; ".join(errors))
        self.notes = [n for n in self.notes if "accepts only" not in n]
        if len(calls) == 1 and errors:
            which = "batched" if calls[0].batched else "unbatched"
            self.notes.append(f"accepts only {which} input ({errors[0]})")
        return calls

    def _ref_x(self, rec: Recorder, x: torch.Tensor) -> torch.Tensor:
        """The reference's input for a call: the probe, or what the projections read where
        the layer transforms its input first (a norm inside the layer)."""
        st = self.structure
        if st is None or not st.pre:
            return x.double()
        found = projection_input(rec, st, x)
        if found is None:
            raise AttnScopeError(
                f"{self.tgt.text}: could not find what its projections read in a second call"
            )
        return found.double()

    def _stage_of(self, call: Call, op: Op) -> Stage | None:
        """The stage of an op in one of the judged calls (read from that call's record)."""
        if call.record is None:
            return None
        try:
            st = read_structure(call.record, self.module)
        except AttnScopeError:
            return None
        return stage_of(call.record, st, op.index)

    def _reference_input(self, rec: Recorder, x: torch.Tensor) -> torch.Tensor:
        return self._ref_x(rec, x).float()

    @staticmethod
    def _shape_ok(out: torch.Tensor, x: torch.Tensor) -> bool:
        return out.dim() == x.dim() and out.shape[:-1] == x.shape[:-1] and out.is_floating_point()

    def _expect_shape(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if not self._shape_ok(out, x):
            raise AttnScopeError(
                f"{self.tgt.text}: expected an output with one row per token, shape "
                f"{fmt_shape((*x.shape[:-1], 'd_out'))}, got {describe(out)}"
            )

    # ------------------------------------------------------------------ sizes and kind
    def _context_limit(self) -> int | None:
        """The longest input the module takes (a probe-size bound, never a verdict): the
        size its configuration declares, unless a longer probe was seen to run (see
        :meth:`_tokens`: SDAR's ``block_size`` is its diffusion block, not nanoGPT's
        context)."""
        if "limit" in self._cache:
            return self._cache["limit"]
        m = self.entry.module if self.entry is not None else self.module
        for holder in (m, self.module, getattr(m, "config", None)):
            for attr in (
                "context_length",
                "block_size",
                "max_seq_len",
                "max_len",
                "n_positions",
                "max_position_embeddings",
                "n_ctx",
            ):
                v = getattr(holder, attr, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
        for _name, buf in self.module.named_buffers():
            square = buf.dim() >= 2 and buf.shape[-1] == buf.shape[-2] and buf.shape[-1] > 1
            if square and _mask_like(buf):  # a causal mask sized for the longest input
                return buf.shape[-1]
        return None

    def _tokens(self, binding: Binding | None) -> int:
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        taken = {BATCH}
        if binding is not None:
            taken |= {binding.d_in, binding.d_out}
            if binding.num_heads:
                taken |= {binding.num_heads, binding.d_out // binding.num_heads}
        limit = self._context_limit()
        if binding is not None and limit is not None and limit < SIZES["tokens"]:
            # a declared size shorter than the usual probe: a bound only where a probe of
            # the usual length does not run (tried once)
            x = torch.randn(BATCH, SIZES["tokens"], binding.d_in, generator=self.discovery_gen)
            try:
                out, err = self._invoke(x)
            except (RuntimeError, AttnScopeError):
                out, err = None, "raised"
            runs = err is None and isinstance(out, torch.Tensor) and self._shape_ok(out, x)
            limit = self._cache["limit"] = None if runs else limit
        # a declared window shorter than the probe, by more than one key: a window one key
        # too wide must not read as no window at all
        # (or, with none declared, the one its mask shows)
        window = self._declared_window() or self._declared_local() or self._seen()
        least = window + 3 if window is not None and window <= 32 else 2
        for n in (SIZES["tokens"], 5, 6, 11, 13, 9, 3, 17, 19, 4, 8, 23, 29, 31, 37):
            if n not in taken and n >= least and (limit is None or n <= limit):
                return n
        return max(2, min(limit or 7, 7))

    def _infer_kind(self, binding: Binding, st: Structure, tokens: int) -> tuple[Kind, str]:
        if st.cross is not None:
            return Kind.of("cross"), (
                f"its keys and values read another sequence than its queries (at {st.cross}); "
                f"{binding.num_heads or 1} heads ({binding.source})"
            )
        second = self._unread_sequence_argument()
        if second is not None:
            # the computation cannot tell a cross-attention layer whose keys read the wrong
            # input from self-attention with an idle argument: the argument's name breaks
            # the tie
            self._expect_second_sequence()
            self.calls = self._probe(self.calls[0].given.float())
            return Kind.of("cross"), (
                f"it takes a second sequence, {second!r}, that its keys and values do not read"
            )
        declared = self._declared_cross()
        if declared is not None:
            # an optional second sequence the layer says it attends to, not passed in
            # discovery: probed with one (keys read from the queries' input then show)
            self._expect_second_sequence()
            self.calls = self._probe(self.calls[0].given.float())
            return Kind.of("cross"), (
                f"it declares cross-attention ({declared}) and takes a second sequence, "
                f"{self._second_name()!r}"
            )
        reasons = []
        heads = binding.num_heads
        multi = (heads or 1) > 1
        if multi:
            reasons.append(f"{heads} heads of {binding.d_out // heads} ({binding.source})")
        causal_why = st.causal or self._declared_causal()
        if causal_why is None and self._behaves_causal(binding.d_in):
            causal_why = "its outputs do not change when later tokens change"
        if causal_why is None:
            causal_why = self._causal_given_padding()
        if causal_why is None:
            causal_why = self._dropped_causal_mask()
        if causal_why:
            reasons.append(f"causal: {causal_why}")
            if multi and self.adapter["hf"]:  # a layer, or a block around it
                self.calls = self._probe(self.calls[0].given.float(), causal_hint=True)
        kind = Kind.weighted_kind(causal=bool(causal_why), multihead=multi)
        if not multi:
            reasons.append(f"one head ({binding.source})")
        return kind, "; ".join(reasons)

    def _causal_given_padding(self) -> str | None:
        """A model that takes an optional padding mask and, handed one that pads nothing,
        masks the future: a decoder (whose path without a mask leaves the causal mask out,
        then a mistake). Nothing padded changes nothing in an encoder."""
        if self.host is not None or self.adapter["hf"] or self.adapter["pair"] or self.cross:
            return None
        try:
            params = inspect.signature(self.module.forward).parameters
        except (TypeError, ValueError):
            return None
        taken = params.get("attention_mask")
        if taken is None or taken.default is not None:
            return None
        gen = torch.Generator().manual_seed(17)
        x = torch.randn(BATCH, self._tokens(self.binding), self._root_width, generator=gen)
        if not self._discovered_batched:
            return None
        ones = {"attention_mask": torch.ones(x.shape[0], x.shape[1], dtype=torch.long)}

        def run(t: torch.Tensor, extra: dict | None):
            try:
                out, err = self._invoke_root(t, extra=extra)
            except AttnScopeError:
                return None
            return None if err is not None or out.shape[:2] != t.shape[:2] else out.double()

        plain, padded = run(x, None), run(x, ones)
        if plain is None or padded is None or torch.allclose(plain, padded, atol=1e-6):
            return None
        late, early = x.clone(), x.clone()
        late[:, -2:] = torch.randn(x.shape[0], 2, x.shape[2], generator=gen) * 3
        early[:, :1] = torch.randn(x.shape[0], 1, x.shape[2], generator=gen) * 3
        after_late, after_early = run(late, ones), run(early, ones)
        if after_late is None or after_early is None:
            return None
        if not torch.allclose(padded[:, :-2], after_late[:, :-2], atol=1e-5, rtol=1e-4):
            return None
        if torch.allclose(padded[:, -1], after_early[:, -1], atol=1e-5):
            return None
        return (
            "handed a padding mask that pads nothing (attention_mask of ones), its model "
            "masks the future: a decoder"
        )

    def _dropped_causal_mask(self) -> str | None:
        """A target whose own computation builds a causal mask for the probe's tokens and
        then drops it (nothing reads it: ``mask = None`` on a path that expected the kernel's
        ``is_causal``, a mask built and never applied): a decoder, as a triangular buffer the
        layer holds and never applies is (:meth:`_declared_causal`); unless the layer or the
        target declares it is not causal."""
        if self.host is not None or self.adapter["hf"] or self.cross:
            return None
        m = self.entry.module if self.entry is not None else self.module
        for holder in (m, self.module):
            for attr in ("is_causal", "causal", "is_decoder"):
                if getattr(holder, attr, None) is False:
                    return None
        dropped = self._dropped()
        if dropped is None:
            return None
        made, held = dropped
        n = self.calls[0].given.shape[-2]
        for where, t in held:
            if t.dim() < 2 or t.shape[-2:] != (n, n):
                continue
            hidden = [t, ~t] if t.dtype == torch.bool else []
            if any(mask_shape(h) == ("causal", 1) for h in hidden):
                return (
                    f"it builds a causal mask at {where} and nothing reads it (a decoder's "
                    "mask dropped?)"
                )
        for op in made:
            t = op.output
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2:] != (n, n):
                continue
            if t.dtype == torch.bool:
                hidden = [t, ~t]
            elif t.is_floating_point():
                hidden = [t <= -1e4]
                if bool(((t == 0) | (t == 1)).all()):
                    hidden.append(t == 0)
            else:
                continue
            if any(mask_shape(h) == ("causal", 1) for h in hidden):
                return (
                    f"it builds a causal mask at {op.location} and nothing reads it (a "
                    "decoder's mask dropped?)"
                )
        return None

    def _dropped(self) -> tuple[list[Op], list[tuple[str, torch.Tensor]]] | None:
        """One more run of the target on the first probe (made once): the tensors its
        computation made from no input and nothing then read, and those its own frames held
        at their return that no recorded call saw (made outside torch:
        ``torch.from_numpy(np.tril(...))``), with where; None where the run is not taken."""
        if "dropped" in self._cache:
            return self._cache["dropped"]
        self._cache["dropped"] = None
        x = self.calls[0].given.float()
        if x.shape[-2] < 3:
            return None
        rec = self._recorder(x)
        try:
            with rec, _locals_at_return() as local:
                _, err = self._invoke_root(x)
        except Exception:  # noqa: BLE001 - a second run it does not take: nothing read
            return None
        if err is not None or len(rec.ops) >= rec.limit:
            return None
        g = Graph(rec)
        read = {a for op in rec.ops for a in op.args}
        made = [
            op
            for op in rec.ops
            if op.index not in read and not g.tainted[op.index] and op.leaf is None and not op.stale
        ]
        held = [(where, t) for where, t in local if not rec.saw(t)]
        self._cache["dropped"] = (made, held)
        return self._cache["dropped"]

    def _position_bias(self, heads: int) -> Alibi | LearnedBias | None:
        """The reference's position bias when the computation adds one to the scores: ALiBi,
        with the slopes it used as read from that bias, or a learned relative bias (see
        :mod:`.relbias`), taken as the layer computes it at each length."""
        st = self.structure
        if st is not None and st.bias is None:
            handed = self._handed_alibi(heads) if self.kind.causal else None
            handed = handed or self._held_alibi(heads)
            if handed is not None:
                return handed
        if st is None or st.bias is None:
            return None
        if st.bias.learned:
            return self._learned_bias(heads)
        if not is_alibi(st.bias.tensor, st.bias.scores_shape, heads):
            raise Unsupported(
                f"{self.tgt.text}: not supported yet: a position bias added to the scores "
                "that is not ALiBi's, slope x distance per head (a relative position bias of "
                f"buckets or learned values, T5's or MPNet's?) at {st.bias.location}"
            )
        seen = read_slopes(st.bias.tensor, st.bias.scores_shape, heads)
        symmetric = is_symmetric(st.bias.tensor, st.bias.scores_shape)
        by_key = is_by_key(st.bias.tensor, st.bias.scores_shape)
        return Alibi(heads, st.bias.before_scale, seen, symmetric, by_key)

    def _learned_bias(self, heads: int) -> LearnedBias:
        """A bias made from the layer's trainable parameters: modelled where it is relative
        (per head a function of the key's offset from the query), read again at each length
        the judge needs (once per head count); refused otherwise."""
        if ("learned", heads) in self._cache:
            return self._cache[("learned", heads)]
        seen = self.structure.bias
        table = relative_table(seen.tensor, seen.scores_shape, heads)
        if table is not None and same_for_every_key(table):
            raise Unsupported(
                f"{self.tgt.text}: not supported yet: a learned bias the same for every key "
                "of a query on these probes (made from what they hold the same for every "
                f"token: variate or segment ids?) at {seen.location}"
            )
        if table is None:
            raise Unsupported(
                f"{self.tgt.text}: not supported yet: a learned position bias that is not "
                "relative, per head a function of the key's offset from the query alone (a "
                "table of absolute positions, or of two-dimensional offsets: Swin's, "
                f"BEiT's?) at {seen.location}"
            )

        def observe(n: int) -> torch.Tensor | None:
            return self._observe_bias(heads, n, seen.location)

        bias = LearnedBias(heads, observe, seen.before_scale, seen.location)
        bias.seen[table.shape[-1]] = table
        self._cache[("learned", heads)] = bias
        return bias

    def _observe_bias(self, heads: int, n: int, location: str | None) -> torch.Tensor | None:
        """The learned bias the layer adds at ``n`` tokens, ``(H, n, n)`` float64, read from
        one more run (its values hang on no input, so any input shows them); None where the
        layer does not take ``n`` tokens or adds no relative bias at the same line there."""
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(BATCH, n, self.binding.d_in, generator=gen)
        if not self._discovered_batched:
            x = x[0]
        ctx = self._context(x) if self.cross else None
        rec = self._recorder(x) if ctx is None else self._recorder(x, ctx)
        try:
            with rec:
                _, err = self._invoke(x)
            st = read_structure(rec, self.module) if err is None else None
        except (RuntimeError, AttnScopeError):
            return None
        if st is None or st.bias is None or not st.bias.learned or st.bias.location != location:
            return None
        return relative_table(st.bias.tensor, st.bias.scores_shape, heads)

    def _handed_alibi(self, heads: int) -> Alibi | None:
        """An ALiBi bias the wrapper hands the layer (Baichuan and MPT models pass it in the
        mask argument) that the layer's output does not depend on: the layer's position
        bias, which it does not add (the judge then names ``bias_missing``). Read as ALiBi
        only where, per head, its finite part is ``slope_h * (j - i)`` plus a constant per
        query, with slopes of one sign and no two heads alike."""
        e = self.entry
        if e is None or not e.extras:
            return None
        if "handed" in self._cache:
            return self._cache["handed"]
        self._cache["handed"] = None
        for key, t in e.extras.items():
            m = t.shape[-1]
            if t.shape[-2] not in (1, m):
                continue
            t = t.expand(*t.shape[:-2], m, m)  # a bias of the key alone (MPT's): every query
            if t.numel() % (heads * m * m):
                continue
            shape = (t.numel() // (heads * m * m), heads, m, m)
            slopes = read_slopes(t.reshape(shape), shape, heads)
            if slopes is None or not _alibi_like(t.reshape(shape), slopes):
                continue
            if self._reads_argument(key):
                continue
            self.notes.append(
                f"the wrapper hands it a position bias (ALiBi, in argument {key!r}) that its "
                "output does not depend on"
            )
            e = t.reshape(shape)
            alibi = Alibi(heads, False, slopes, is_symmetric(e, shape), is_by_key(e, shape))
            self._cache["handed"] = alibi
            return alibi
        return None

    def _held_alibi(self, heads: int) -> Alibi | None:
        """ALiBi slopes the layer holds (a buffer or parameter of one value per head, the
        geometric slopes of :func:`attnscope.functional.alibi_slopes`) that its output does
        not depend on: a position bias built and never added (a ``score_mod`` defined and
        not passed), which the judge then names ``bias_missing``; unless the layer or its
        configuration switches ALiBi off (``alibi=False``, another
        ``position_embedding_type``)."""
        if "held" in self._cache:
            return self._cache["held"]
        self._cache["held"] = None
        m = self.entry.module if self.entry is not None else self.module
        for holder in self._declaring(m):
            if any(getattr(holder, a, None) is False for a in ("alibi", "use_alibi")):
                return None  # declared, and switched off
            kind = getattr(holder, "position_embedding_type", None)
            if isinstance(kind, str) and "alibi" not in kind.lower():
                return None  # another position embedding declared
        want = alibi_slopes(heads).double()
        seen: set[int] = set()
        # the layer's, then the target's (a model keeps its ALiBi module beside its blocks)
        owners = dict.fromkeys([m, self.module])
        held = [(n, t) for mod in owners for n, t in mod.named_buffers()]
        held += [(n, t) for mod in owners for n, t in mod.named_parameters()]
        for name, t in held:
            if id(t) in seen or not t.is_floating_point() or t.numel() != heads or heads < 2:
                continue
            seen.add(id(t))
            if not torch.allclose(t.detach().double().flatten(), want, rtol=1e-4, atol=0):
                continue
            if self._reads_tensor(t):
                continue
            self.notes.append(
                f"it holds ALiBi slopes ({name!r}, one per head) that its output does not depend on"
            )
            alibi = Alibi(heads, False, want, False)
            self._cache["held"] = alibi
            return alibi
        return self._built_alibi(heads)

    def _built_alibi(self, heads: int) -> Alibi | None:
        """An ALiBi matrix ``(..., H, S, S)`` the target or a module on the way to the layer
        keeps (a buffer, or a tensor attribute: MosaicBERT's encoder builds one for its
        layers) that the layer's output does not depend on: built for the layers and never
        handed them (``bias_missing``)."""
        path = self.entry.path if self.entry is not None else ""
        holders = [self.module]
        parts = path.split(".") if path else []
        for i in range(1, len(parts)):
            try:
                holders.append(self.module.get_submodule(".".join(parts[:i])))
            except AttributeError:
                break
        seen: set[int] = set()
        for holder in holders:
            found = [*holder.named_buffers(recurse=False), *vars(holder).items()]
            for name, t in found:
                if not isinstance(t, torch.Tensor) or id(t) in seen or not t.is_floating_point():
                    continue
                seen.add(id(t))
                if t.dim() < 3 or t.shape[-3] != heads or t.shape[-1] != t.shape[-2]:
                    continue
                n = min(t.shape[-1], 16)
                if n < 3:
                    continue
                e = t.detach().reshape(-1, heads, *t.shape[-2:])[:1, :, :n, :n].double()
                slopes = read_slopes(e, tuple(e.shape), heads)
                upper = torch.ones(n, n, dtype=torch.bool).triu(1)
                if slopes is None or not _alibi_like(e.masked_fill(upper, -torch.inf), slopes):
                    continue
                if self._reads_tensor(t):
                    continue
                self.notes.append(
                    f"{name!r} is an ALiBi bias built for the layers that its output does not "
                    "depend on"
                )
                alibi = Alibi(
                    heads,
                    False,
                    slopes,
                    is_symmetric(e, tuple(e.shape)),
                    is_by_key(e, tuple(e.shape)),
                )
                self._cache["held"] = alibi
                return alibi
        return self._dropped_alibi(heads) or self._declared_alibi(heads)

    def _declared_alibi(self, heads: int) -> Alibi | None:
        """ALiBi its configuration switches on (``alibi=True``, MPT's ``attn_config``
        ``{"alibi": True}``) in a layer that adds no position bias: ``bias_missing``, the
        standard slopes expected."""
        if self.host is not None or heads < 2:
            return None
        m = self.entry.module if self.entry is not None else self.module

        def switched_on(d: dict) -> bool:  # ``alibi``, ``use_alibi``, ``alibi_in_attention``
            return any("alibi" in str(k).lower() and v is True for k, v in d.items())

        for holder in self._declaring(m):
            found = switched_on({a: getattr(holder, a, None) for a in ("alibi", "use_alibi")})
            found = found or switched_on(_settings(holder))
            for name in ("attn_config", "attention_config"):
                sub = getattr(holder, name, None)
                if isinstance(sub, dict):
                    found = found or switched_on(sub)
            if found:
                self.notes.append(
                    "its configuration switches ALiBi on, and it adds no position bias"
                )
                alibi = Alibi(heads, False, alibi_slopes(heads).double(), False)
                self._cache["held"] = alibi
                return alibi
        return None

    def _dropped_alibi(self, heads: int) -> Alibi | None:
        """An ALiBi matrix ``(..., H, T, T)`` the target's forward builds for the probe's
        tokens and that nothing then reads (the model makes the bias and hands its blocks
        ``None``): ``bias_missing``, as a bias held and never handed is."""
        if self.host is not None or self.cross or heads < 2:
            return None
        dropped = self._dropped()
        if dropped is None:
            return None
        n = self.calls[0].given.shape[-2]
        upper = torch.ones(n, n, dtype=torch.bool).triu(1)
        for op in dropped[0]:
            t = op.output
            if not t.is_floating_point() or t.dim() < 3 or t.shape[-3:] != (heads, n, n):
                continue
            e = t.detach().reshape(-1, heads, n, n)[:1].double()
            slopes = read_slopes(e, tuple(e.shape), heads)
            if slopes is None or not _alibi_like(e.masked_fill(upper, -torch.inf), slopes):
                continue
            self.notes.append(
                f"it builds an ALiBi bias at {op.location} that nothing reads (the layers are "
                "handed none?)"
            )
            alibi = Alibi(
                heads, False, slopes, is_symmetric(e, tuple(e.shape)), is_by_key(e, tuple(e.shape))
            )
            self._cache["held"] = alibi
            return alibi
        return None

    def _moved(self, out: torch.Tensor | None, err) -> bool:
        """Whether a changed call's output differs from the first probe's (one that failed
        or changed shape counts as read: nothing is concluded from it)."""
        base = self.calls[0]
        if err is not None or out is None or out.shape != base.out.shape:
            return True
        return not close(out.double(), base.out, rtol=1e-6)

    def _reads_tensor(self, t: torch.Tensor) -> bool:
        """Whether the layer's output changes when this buffer or parameter does."""
        base = self.calls[0]
        x = base.given.float()
        if x.dim() != 3:
            return True
        saved = t.detach().clone()
        try:
            with torch.no_grad():
                t.mul_(2.0).add_(0.5)
            out, err = self._invoke(x, self.causal_hint)
        finally:
            with torch.no_grad():
                t.copy_(saved)
        return self._moved(out, err)

    def _reads_argument(self, key) -> bool:
        """Whether the layer's output changes when this argument's finite entries do."""
        base = self.calls[0]
        if not base.batched:
            return True
        x = base.given.float()

        def nudge(a):
            if not isinstance(a, torch.Tensor) or not a.is_floating_point():
                return a
            finite = torch.isfinite(a) & (a > -1e4)
            noise = torch.randn(a.shape, generator=self.gen).to(a.dtype)
            return torch.where(finite, a + noise, a)

        out, err = self._invoke_layer(x, self.causal_hint, change=(key, nudge))
        return self._moved(out, err)

    def _declared_cross(self) -> str | None:
        """A layer that says it is cross-attention (``is_cross_attention=True``, as BLIP-2's
        Q-Former and BERT-style layers do), called by a target whose optional second input
        is named like another sequence, which discovery did not pass: the flag, or None."""
        if not self.adapter.get("optional_second") or self._second_name() is None:
            return None
        m = self.entry.module if self.entry is not None else self.module
        for holder in dict.fromkeys((m, self.module)):
            for attr in ("is_cross_attention", "cross_attention", "is_cross"):
                if getattr(holder, attr, None) is True:
                    return f"{attr}=True"
        return None

    def _second_name(self) -> str | None:
        """The second positional parameter of the target's forward, where it is named like
        another sequence (encoder states, a context, memory), or None."""
        try:
            params = [
                p
                for p in inspect.signature(self.module.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            return None
        if len(params) < 2:
            return None
        name = params[1].name
        return name if _names_a_sequence(name) else None

    def _unread_sequence_argument(self) -> str | None:
        """The name of a second required input named like another sequence (encoder
        states, a context, memory) that the computation never reads, or None."""
        if self.host is not None:
            key = self._unread_context
            if key is None or self.cross:
                return None
            return key if isinstance(key, str) else self._parameter_name(key)
        if not self.adapter["pair"] or self._second_read:
            return None
        return self._second_name()

    def _window(self) -> int | None:
        """The sliding window the reference holds the layer to: the one its (or its
        model's) configuration declares, else the one its mask shows. Causal kinds see
        their last keys; the others (a bidirectional local window) the keys on either side.
        """
        st = self.structure
        local = st is not None and st.local is not None
        if local and self.kind.causal and not self.kind.cross and st.window is not None:
            # a band on either side beside the causal mask (llm-foundry's tril(w) & triu(-w)
            # after its causal mask): the query and the keys before it within the band. A
            # declared w (the keys in all, or llm-foundry's half-width) that neither reading
            # makes the band seen holds it to w + 1 keys, the half-width's
            seen = (st.window[0] + 1) // 2
            declared = self._declared_window()
            return seen if declared is None or seen in (declared, declared + 1) else declared + 1
        if local and (self.kind.causal or self.kind.cross):
            # keys on either side across two sequences: not modelled
            raise Unsupported(f"{self.tgt.text}: not supported yet: {st.local}")
        if self.kind.cross:
            return None
        if not self.kind.causal:
            declared = self._declared_local()
            if declared is not None:
                return declared
            if not local:
                return None
            seen, width = st.window[0], self._declared_window()
            if width is not None and seen not in (2 * width + 1, width + 1, width):
                # a width declared (``window_size = 3``) that no reading makes the band seen:
                # keys on either side (flash-attn's |i - j| <= w, 2w + 1 keys), Longformer's
                # w // 2 on either side, or the keys in all
                return 2 * width + 1
            return seen
        declared = self._declared_window()
        if declared is not None:
            return declared
        return st.window[0] if st is not None and st.window is not None else None

    def _seen(self) -> int | None:
        st = self.structure
        return st.window[0] if st is not None and st.window is not None else None

    def _packed_leak(self) -> torch.Tensor | None:
        st = self.structure
        return st.packed_leak[0] if st is not None and st.packed_leak is not None else None

    def _window_seen(self) -> int | None:
        """The window the layer's mask shows (see :meth:`_window`)."""
        st = self.structure
        if st is None or st.window is None or (st.local is not None) == self.kind.causal:
            return None
        return st.window[0]

    def _wrapper_reads(self, attr: str) -> bool:
        """Whether the code of the target or of a module between it and the layer names
        ``attr`` (a window its configuration holds for other models of a family, YOCO's
        arguments shared by its baseline Transformer, declares nothing where no code on
        the way to the layer reads it)."""
        if self.entry is None:
            return True
        path = self.entry.path.split(".")
        mods = [self.module] + [
            self.module.get_submodule(".".join(path[:i])) for i in range(1, len(path))
        ]
        for mod in mods:
            try:
                src = inspect.getsource(type(mod))
            except (OSError, TypeError):
                return True  # no source to read: as declared
            if attr in src:  # torchtitan's get_sliding_window_mask_mod(...) names it too
                return True
        return False

    def _declaring(self, m: nn.Module) -> list:
        """Where a layer's settings are declared: the layer and the target, and the
        configuration each holds (a Hugging Face ``config``; the ``model_args`` or ``args``
        dataclass of torchtitan- and Llama-style code)."""
        out = []
        for owner in (m, self.module):
            out.append(owner)
            out += [getattr(owner, a, None) for a in _CONFIG_HOLDERS]
        # an attention backend the layer keeps (vLLM's and Aphrodite's ``Attention``, which
        # holds the heads, the scale and the window): a child module with no weights
        out += [c for c in m.children() if not any(True for _ in c.parameters())]
        return [h for h in out if h is not None]

    def _declared_local(self) -> int | None:
        """A bidirectional local window its layer or configuration declares, as keys a query
        sees (itself included): a ``(left, right)`` pair (ModernBERT's layers: ``(-1, -1)``
        for a global one), or one width split evenly on both sides (ModernBERT's and
        Longformer's configurations: ``w // 2`` keys on either side)."""
        m = self.entry.module if self.entry is not None else self.module
        for holder in self._declaring(m):
            for attr in ("local_attention", "attention_window"):
                v = getattr(holder, attr, None)
                if isinstance(v, tuple) and len(v) == 2:  # (a list is one width per layer)
                    if not _int_pair(v):
                        return None
                    if min(v) < 0 or v[0] != v[1]:
                        return None  # none (a global layer), or one of another shape
                    return v[0] + v[1] + 1
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return 2 * (v // 2) + 1
        return None

    def _declared_window(self) -> int | None:
        m = self.entry.module if self.entry is not None else self.module
        if "sliding_window" in vars(m) and m.sliding_window is None:
            return None  # the layer says it has none (a full-attention layer of its model)
        if any(getattr(m, a, None) is False for a in ("is_sliding", "local", "is_local")):
            return None  # the layer says it is not a sliding one (EXAONE 4's, Samba's full ones)
        converted: list[int | None] = []
        # the layer's own settings (itself, its configuration, a backend it keeps)
        own = {id(m)} | {id(getattr(m, a, None)) for a in _CONFIG_HOLDERS if hasattr(m, a)}
        own |= {id(c) for c in m.children() if not any(True for _ in c.parameters())}
        for holder in self._declaring(m):
            if getattr(holder, "use_sliding_window", True) is False:
                continue  # declared, and switched off (Qwen 2 configs)
            if _declares_global(holder):
                break  # a window size held, and the layer's type says global
            for attr in _WINDOW_NAMES:
                v = getattr(holder, attr, None)
                if v is None or (id(holder) not in own and not self._wrapper_reads(attr)):
                    continue  # none, or the wrapper's settings, which nothing on the way reads
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
                if _left_only(v):
                    # flash-attn's and TransformerEngine's (left, right) keys on either side
                    # of the query, none to the right: a causal window of left + 1 keys. A
                    # window of keys declared further out (the config's, OLMo-core's) is
                    # what such a pair is converted from: it wins where they disagree
                    converted.append(None if v[0] < 0 else v[0] + 1)
        return converted[0] if converted else None

    def _softcap(self) -> float | None:
        """The logit soft-capping the layer (or its configuration) declares, where its
        scores go through a tanh (Gemma 2's ``attn_logit_softcapping``); a tanh on the
        scores with none declared is not modelled: refused."""
        st = self.structure
        m = self.entry.module if self.entry is not None else self.module
        declared = None
        for holder in (
            m,
            getattr(m, "config", None),
            self.module,
            getattr(self.module, "config", None),
        ):
            v = getattr(holder, "attn_logit_softcapping", None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                declared = float(v)
                break
        if st is None or st.softcap is None:
            return None
        if declared is None:
            raise Unsupported(
                f"not supported yet: logit soft-capping (a tanh on the scores) at {st.softcap}, "
                "with no attn_logit_softcapping declared"
            )
        self.notes.append(f"logit soft-capping at {declared:g} (attn_logit_softcapping)")
        return declared

    def _out_norm(self) -> ContextNorm | None:
        """The norm the layer applies to its merged heads before the output projection (a
        sub-LayerNorm), read from a recorded call: which norm, its gain and shift are the
        hypothesis that makes the projection's input from the merged context exactly; where
        none does (a gate, a norm of another form) it stays a thing not modelled, which the
        layer is refused for unless a known mistake explains its output."""
        st = self.structure
        if st is None or st.out_norm is None:
            return None
        if "out_norm" in self._cache:
            return self._cache["out_norm"]
        _, what, where = st.out_norm
        found = None
        call = self._rope_call()
        if call is not None:
            try:
                seen = read_structure(call.record, self.module)
            except (AttnScopeError, RuntimeError):
                seen = None
            if seen is not None and seen.out_norm is not None and seen.out is not None:
                found = _context_norm(call.record, seen)
        self._cache["out_norm"] = found
        if found is None:  # left on the list of what is not modelled
            return None
        st.unmodelled = [(w, at) for w, at in st.unmodelled if w != what]
        kind = "RMSNorm" if found.kind == "rms" else "LayerNorm"
        self.notes.append(
            f"a {kind} over the merged heads before the output projection read from the "
            f"computation (at {where})"
        )
        return found

    def _declared_scale(self, head_dim: int) -> tuple[float | None, str]:
        """A scale the layer's (or its model's) configuration declares in place of
        1/sqrt(d_k): Gemma's ``query_pre_attn_scalar`` (scores times its 1/sqrt), Granite's
        ``attention_multiplier``; times the square of the ``attention_scaling`` that the
        model's own rotary class folds into its cos and sin (YaRN's attention factor: both
        queries and keys carry it); ``(None, "")`` where none is declared."""
        scale, source = None, ""
        m = self.entry.module if self.entry is not None else self.module
        for holder in (getattr(m, "config", None), getattr(self.module, "config", None)):
            v = getattr(holder, "query_pre_attn_scalar", None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                scale, source = v**-0.5, f"1/sqrt(query_pre_attn_scalar) = 1/sqrt({v:g})"
                break
            v = getattr(holder, "attention_multiplier", None)
            if isinstance(v, float) and v > 0:
                scale, source = v, f"attention_multiplier = {v:g}"
                break
        factor = getattr(self._hf_rotary, "attention_scaling", None)
        if self._hf_layer_type is not None:  # one factor per layer type (Gemma 3)
            factor = getattr(self._hf_rotary, f"{self._hf_layer_type}_attention_scaling", factor)
        if isinstance(factor, (int, float)) and factor > 0 and not math.isclose(factor, 1.0):
            scale = (scale or head_dim**-0.5) * factor * factor
            source = (
                f"{source or f'1/sqrt(d_k) = 1/sqrt({head_dim})'} times the square of the "
                f"rotary embedding's attention_scaling {factor:.4g} (in its cos and sin)"
            )
        return scale, source

    def _multipliers(self, scale, source: str, b: Binding, heads: int):
        """The scale, times each constant the queries or keys are multiplied by on their way
        to the scores that is no power of the layer's sizes (a muP multiplier, Falcon-H1's
        ``key_multiplier``: the weights' own factor, as if folded into them). A factor that
        is a power of the sizes (the scale itself, d_k**-0.25 on both sides) or of the
        declared scale stays for the judge, which names it when it is wrong (the scale
        applied twice)."""
        found = getattr(self.structure, "qk_factors", None) or {}
        hd = b.d_out // heads
        kv = (self.structure.kv_heads,) if getattr(self.structure, "kv_heads", None) else ()
        sizes = {hd, b.d_in, b.d_out, heads, *kv}
        sized = {2.0, 0.5} | {
            float(n) ** e for n in sizes if n > 1 for e in (-1, -0.5, -0.25, 0.25, 0.5, 1)
        }
        if scale is not None:  # the declared scale folded in (Gemma's query_pre_attn_scalar)
            sized |= {scale, scale**0.5, 1 / scale, scale**-0.5}
        undone = getattr(self.structure, "score_factors", None) or []
        for role, factor, where in found.values():
            if any(math.isclose(abs(factor), v, rel_tol=1e-4) for v in sized):
                continue
            if any(math.isclose(factor * c, 1.0, rel_tol=1e-6) for c in undone):
                continue  # multiplied back on the scores before the softmax: no multiplier
            which = "queries" if role == "queries" else "keys"
            if self.plain_factors:
                continue  # judged as it stands: a slip in the scale, if it is one
            if (which, factor, where) not in self.multipliers:
                self.multipliers.append((which, factor, where))
            scale = (hd**-0.5 if scale is None else scale) * factor
            source = (
                f"{source or f'1/sqrt(d_k) = 1/sqrt({hd})'} times the constant {factor:.6g} "
                f"the {which} are multiplied by at {where} (a multiplier of the weights, muP's)"
            )
            note = (
                f"the {which} multiplied by {factor:.6g} at {where}: no power of the layer's "
                "sizes, read as a multiplier of their weights (muP's), part of the scale"
            )
            if note not in self.notes:
                self.notes.append(note)
        return scale, source

    def _declared_causal(self) -> str | None:
        """A causal layer whose computation shows no mask: it says so in a flag, or holds a
        triangular mask it never applies (the check then names the missing mask)."""
        m = self.entry.module if self.entry is not None else self.module
        for attr in ("is_causal", "causal"):
            v = getattr(m, attr, None)
            if isinstance(v, bool):
                return f"{attr}={v}" if v else None
        for name, buf in m.named_buffers():
            if buf.dim() >= 2 and buf.shape[-1] == buf.shape[-2] and buf.shape[-1] > 1:
                sq = buf.reshape(-1, *buf.shape[-2:])[0].bool()
                n = sq.shape[-1]
                ones = torch.ones(n, n, dtype=torch.bool)
                if any(torch.equal(sq, t) for t in (ones.triu(1), ones.tril(), ones.tril(-1))):
                    return f"a triangular buffer {name!r} {tuple(buf.shape)} (a causal mask)"
        return None

    def _behaves_causal(self, d_in: int) -> bool:
        """Outputs that ignore later tokens and heed earlier ones."""
        base = self.calls[0]

        def changed(positions: slice) -> torch.Tensor | None:
            x = base.given.float().clone()
            n = x[:, positions].shape[1]
            x[:, positions] = torch.randn(x.shape[0], n, d_in, generator=self.gen) * 3
            out, err = self._invoke(x if base.batched else x[0])
            if err is not None:
                return None
            out = out.double() if base.batched else out.double().unsqueeze(0)
            return out if out.shape == base.out.shape else None

        late, early = changed(slice(-2, None)), changed(slice(0, 1))
        if late is None or early is None:
            return False
        ignores_later = torch.allclose(base.out[:, :-2], late[:, :-2], atol=1e-5, rtol=1e-4)
        changed_late = not torch.allclose(base.out[:, -2:], late[:, -2:], atol=1e-5)
        heeds_earlier = not torch.allclose(base.out[:, -1], early[:, -1], atol=1e-5)
        return ignores_later and changed_late and heeds_earlier

    def _specs(self, b: Binding) -> list[tuple[Weights, Spec]]:
        if self.kind.multihead:
            heads = (
                [b.num_heads]
                if b.num_heads
                else [h for h in range(1, b.d_out + 1) if b.d_out % h == 0]
            )
        else:
            heads = [1]
        out = []
        softcap = self._softcap()
        out_norm = self._out_norm()
        for h in heads:
            scale, source = self._declared_scale(b.d_out // h)
            scale, source = self._multipliers(scale, source, b, h)
            for w in b.candidates:
                hd = b.d_out // h
                k_width = w.k.shape[1]
                if k_width != b.d_out and (k_width % hd or h % (k_width // hd)):
                    continue  # keys of another width: grouped heads only if they divide
                kv = k_width // hd if k_width != b.d_out else None
                spec = Spec(
                    self.kind,
                    b.d_in,
                    b.d_out,
                    h,
                    b.has_out,
                    kv_heads=kv,
                    window=self._window(),
                    window_seen=self._window_seen(),
                    position_bias=self._position_bias(h),
                    declared_scale=scale,
                    scale_source=source,
                    softcap=softcap,
                    out_norm=out_norm,
                    packed_leak=self._packed_leak(),
                )
                out.append((w, spec))
                if isinstance(spec.position_bias, LearnedBias) and scale is None:
                    # T5's convention: beside its learned relative bias, no scale (folded
                    # into the query weights' initialization); read after the standard one
                    out.append((w, dataclasses.replace(spec, declared_scale=1.0, scale_source=_T5)))
        if not out:
            raise Unsupported(
                f"{self.tgt.text}: not supported yet: keys and values "
                f"{b.candidates[0].k.shape[1]} wide and queries {b.d_out}: widths that do not "
                "compose as heads (expected the same width, or grouped heads: key/value heads "
                "dividing the query heads; queries made by experts a router picks?)"
            )
        return self._with_rope(out)

    def _with_rope(self, options: list[tuple[Weights, Spec]]) -> list[tuple[Weights, Spec]]:
        """The readings whose rotary embedding and QK norm the computation confirms (see
        :mod:`.rotary`, :mod:`.qknorm`), each with them; what no reading explains as a
        rotation and a norm is refused."""
        st = self.structure
        if st is None or not (st.rotary or st.qk_norm):
            return options
        kept, exact = [], []
        for w, spec in options:
            read = self._read_modern(spec, w)
            if read is not None:
                rope, norm, rms_exactly = read
                kept.append((w, dataclasses.replace(spec, rope=rope, qk_norm=norm)))
                exact.append(rms_exactly)
        if exact and exact[0]:
            st.unmodelled = [u for u in st.unmodelled if not u[0].startswith("cosine attention")]
        if not kept:
            what, where = next(iter({**st.qk_norm, **st.rotary}.values()))
            if st.unmodelled:
                # an operation the reference does not model, seen on the way, is why no
                # reading explains the rotation (a gate made with the queries): named first
                what, where = st.unmodelled[0]
            if st.cache is not None:  # the keys are a cache's, not the sequence's: why
                what, where = st.cache
            raise Unsupported(f"not supported yet: {what}" + (f" at {where}" if where else ""))
        spec = kept[0][1]
        if spec.rope is not None:
            r = spec.rope
            self.notes.append(
                f"rotary position embedding read from the computation: {r.pairing} pairing, "
                f"{r.rot} of {spec.head_dim} features per head"
                + (f", base {r.base:g}" if r.base else ", the layer's own frequencies")
            )
        if spec.qk_norm is not None:
            n = spec.qk_norm
            kind = "RMSNorm" if n.kind == "rms" else "LayerNorm"
            over = "per head" if n.scope == "per-head" else "over the whole projection"
            self.notes.append(f"QK norm read from the computation: {kind} {over}")
        return kept

    def _read_modern(
        self, spec: Spec, w: Weights
    ) -> tuple[Rope | None, QKNorm | None, bool] | None:
        """What happens between this reading's projected heads and what the scores were
        made from: a rotation, a norm, both, or nothing, and whether the norm is an RMSNorm
        with no factor of its own left over; None when that is not it."""
        call = self._rope_call()
        if call is None:
            return None
        try:
            st = read_structure(call.record, self.module)
            q, k, v = project(call.x, spec, w, call.context)
            keys = [k]
            if call.context is not None and call.context.shape[-1] == call.x.shape[-1]:
                # keys projected from the queries' input instead (wrong_source): read the
                # norm on what the layer did, and let the stages judge the source
                keys.append(project(call.x, spec, w)[1])
            # keys made with another projection (wrong_projection): the value projection
            # (a fused split unpacked as q, v, k; a fused key/value as v, k), or the query
            # projection's first columns (grouped heads)
            if call.context is None and spec.kv != spec.num_heads:
                keys.append(q[..., : k.shape[-1]])
            keys.append(v)
        except (AttnScopeError, RuntimeError):
            return None
        core = st.cores[0]
        b = call.x.shape[0]
        hd = spec.head_dim
        graph = Graph(call.record)
        stops = st.projection_ops

        def read_sides(q_node: int, k_node: int) -> tuple[dict, float] | None:
            """Each side's reading (rotation, norm) and the norms' epsilon, or None."""
            sides, eps = {}, 0.0
            # heads cut wrongly (the mistake heads_split) are rotated and normed all the same:
            # those cuts are read too, after the right one, and the judge names the mistake
            q_cuts = [split, *WRONG_CUTS] if spec.num_heads > 1 else [split]
            k_cuts = [split, *WRONG_CUTS] if spec.kv > 1 else [split]
            q_cut = [(cut, q, spec.num_heads) for cut in q_cuts]
            k_cut = [(cut, k, spec.kv) for cut in k_cuts for k in keys]
            one_weight = st.shared.get("k") == "q" and st.shared.get("v") == "q"
            if spec.kv == spec.num_heads > 1 and one_weight and q.shape == k.shape == v.shape:
                # one combined projection reshaped wrongly before q, k, v are cut from it
                for mixed in packed_scrambles(spec.num_heads):
                    q2, k2, _ = mixed(q, k, v)
                    q_cut.append((split, q2, spec.num_heads))
                    k_cut.append((split, k2, spec.kv))
            for role, word, node, cuts in (
                ("q", "queries", q_node, q_cut),
                ("k", "keys", k_node, k_cut),
            ):
                sources = [cut(t, h) for cut, t, h in cuts]
                path = [
                    call.record.ops[i]
                    for i in sorted(graph.ancestors(node, stop=stops))
                    if i not in stops and call.record.ops[i].leaf is None
                ]
                eps = eps_on_path(call.record.ops, path)
                found = None
                for (how, flat, h_cut), ref in zip(cuts, sources, strict=True):
                    # a full-width norm is taken before a wrong cut, as the layer takes it
                    wrong = None if how is split else (flat, lambda t, f=how, h=h_cut: f(t, h))
                    gains = []
                    if word in st.qk_norm:
                        widths = {hd, ref.shape[1] * hd}
                        gains = gains_on_path(call.record.ops, graph, path, widths)
                    turned = _rotations_on_path(path, ref, b, hd) if word in st.qk_norm else []
                    # (entries the operand holds, the heads of it that are the kv heads once)
                    kv = ref.shape[1]
                    refs = [(ref.numel(), None)]
                    if kv != spec.num_heads:  # keys repeated for the query heads first
                        g = spec.num_heads // kv
                        heads = (torch.arange(kv) * g, torch.arange(kv))  # interleaved, tiled
                        refs += [(ref.numel() * g, h) for h in heads]

                    def forms(numel, once, node=node, role=role, ref=ref) -> list[torch.Tensor]:
                        # the operand, or the whole tensor a piece of it was cut from (a part
                        # of the repeated keys can hold as many entries as the keys themselves),
                        # in each heads layout; repeated keys cut to one copy of each kv head
                        user = _whole(call.record, graph, node, numel)
                        if user.numel() != numel:
                            user = _per_core(call.record, graph, st.cores, role, numel, user)
                        user = user.to(torch.float64)
                        if role == "k" and user.numel() != numel:
                            # keys read back from a static cache: the slots it wrote, no others
                            user = _written_slots(user, seen_keys(graph, core), ref.shape[2])
                        h = ref.shape[1] if once is None else spec.num_heads
                        found = as_heads(user, b, h, ref.shape[2], hd)
                        if role == "k":
                            # keys written one slot off into a cache (a 1-based position used
                            # as a slot, a ring buffer's + 1): their rotation read on the
                            # slots rolled back, after the slots as they are; the scores'
                            # stage names the mistake (wrong_key_index)
                            found += [f.roll(r, dims=-2) for r in (1, -1) for f in found]
                        return found if once is None else [f[:, once] for f in found]

                    found = next(
                        (
                            side
                            for numel, once in refs
                            for form in forms(numel, once)
                            if (side := read_side(ref, form, gains, eps, turned, wrong)) is not None
                        ),
                        None,
                    )
                    if found is not None:
                        break
                if found is None and word not in st.qk_norm and word in st.rotary:
                    found = _rotated_in_place(call.record, graph, path, stops, node, sources[0], hd)
                if found is None:
                    return None
                sides[role] = found
            return sides, eps

        # the scores' operands by their place in the product; the other way round where
        # the keys come first (keys times queries: the mistake scores_transposed)
        read = read_sides(core.q_node, core.k_node) or read_sides(core.k_node, core.q_node)
        if read is None:
            return None
        sides, eps = read
        turned = [r for r, s in sides.items() if s.tables.turns]
        if call.context is not None and len(turned) == 1:
            # one side of a cross layer rotated: its keys hold another sequence's positions,
            # and rotating the queries alone is a design (Surya's text decoder over image
            # features), which the reference does not model; no verdict either way
            side = "queries" if turned == ["q"] else "keys"
            where = next(iter(st.rotary.values()), (None, None))[1]
            raise Unsupported(
                f"not supported yet: rotary position embedding on the {side} only of a "
                "cross-attention layer (its other side another sequence's)"
                + (f" at {where}" if where else "")
            )
        rope = None
        if st.rotary or any(s.tables.turns for s in sides.values()):
            rope = read_rope(sides["q"].tables, sides["k"].tables, hd)
        norm = None
        normed = [s for s in sides.values() if s.normed]
        if normed:
            first = next((s for s in normed if not s.misplaced), normed[0])
            gain = {r: (s.gain, s.bias) if s.normed else (None, None) for r, s in sides.items()}
            norm = QKNorm(first.scope, first.kind, *gain["q"], *gain["k"], eps=eps)
        elif st.qk_norm:
            return None
        # an RMSNorm exactly, with no factor of its own left over: F.normalize times sqrt(d)
        # (TRELLIS's MultiHeadRMSNorm) is that, not cosine attention's unit length
        rms_exactly = bool(normed) and all(
            s.kind == "rms" and abs(s.tables.scale - 1) < 1e-3 for s in normed
        )
        return rope, norm, rms_exactly

    def _rope_call(self) -> Call | None:
        """One recorded call on a wider batch, made once: every (token, feature) of a
        rotation is fitted over the sequences and heads, and a multi-query layer's single
        key head needs more sequences than the judged probe has to pin two unknowns."""
        if self._rope_probe is None:
            n = self.calls[0].x.shape[1]
            x = torch.randn(_ROPE_BATCH, n, self.calls[0].given.shape[-1], generator=self.gen)
            ctx = self._context(x) if self.cross else None
            rec = self._recorder(x) if ctx is None else self._recorder(x, ctx)
            with rec:
                out, err = self._invoke(x, self.causal_hint)
            self._rope_probe = (
                []
                if err is not None
                else [
                    Call(
                        self._ref_x(rec, x),
                        out.double(),
                        True,
                        rec.ops,
                        record=rec,
                        context=self._cross_inputs(rec, ctx)[0],
                    )
                ]
            )
        return self._rope_probe[0] if self._rope_probe else None

    # ------------------------------------------------------------------ judging
    def _short_probe(self) -> list[Call] | None:
        """The same calls on a short input (see :meth:`Judge._explain_quickly`)."""
        notes, fixed = list(self.notes), self.fixed_tokens
        self.fixed_tokens = None
        try:
            d_in = self.calls[0].given.shape[-1]
            x = torch.randn(BATCH, self._tokens(self.binding), d_in, generator=self.gen)
            return self._probe(x, self.causal_hint)
        except AttnScopeError:
            return None
        finally:
            self.notes, self.fixed_tokens = notes, fixed

    def _varies(self) -> tuple[Stage, str, str | None] | None:
        """Run the first call again: attention in eval mode must give the same output."""
        first = self.calls[0]
        given = first.given.float() if first.batched else first.given[0].float()
        rec = self._recorder(given)
        with rec:
            out, err = self._invoke(given, self.causal_hint)
        if err is not None:
            return None
        out = out.double() if first.batched else out.double().unsqueeze(0)
        if out.shape != first.out.shape or close(out, first.out, rtol=1e-6):
            return None  # the same, up to reductions that may run in another order
        dropout = [op for op in rec.ops if "dropout" in op.name and op.leaf is None]
        where = dropout[0].location if dropout else None
        stage = Stage.OUTPUT
        if dropout:  # the stage the dropout acts on: the weights as a rule, not always
            stage = self._stage_of(Call(first.x, out, first.batched, record=rec), dropout[0])
            stage = stage or Stage.WEIGHTS
        cause = "dropout that stays on in eval mode (F.dropout's training=True default?)"
        msg = (
            f"{stage.value}: the output changes from one run to the next on the same input, "
            f"in eval mode: {cause if dropout else 'something random in the computation'}. "
            "Expected a deterministic result once model.eval() is called"
        )
        if where:
            msg += f". Look at {where}"
        return stage, msg, where

    def _structure_report(self, spec: Spec) -> dict:
        """What was read from the computation, for the report's ``structure``."""
        out = single_head(spec.d_out, self.kind.causal)
        if spec.multihead:
            out.update(heads=spec.num_heads, kv_heads=spec.kv, head_dim=spec.head_dim)
        out.update(
            rope=None if spec.rope is None else spec.rope.describe(),
            qk_norm=None if spec.qk_norm is None else spec.qk_norm.scope,
            window=spec.window,
            bias=_bias_word(spec.position_bias),
            cross=spec.kind.cross,
        )
        return out

    def _judge(self, options: list[tuple[Weights | None, Spec]]) -> CheckReport:
        judge = Judge(
            target=self.tgt.text,
            kind=self.kind,
            kind_reason=self.kind_reason,
            notes=self.notes,
            calls=self.calls,
            invoke=lambda x: self._invoke(x, self.causal_hint),
            reprobe=self._short_probe,
            recorder=self._recorder,
            stage_of=self._stage_of,
            reference_input=self._reference_input
            if self.structure and self.structure.pre
            else None,
        )
        judge.varies = self._varies()
        judge.longer = self._longer_length()
        if self.structure is not None:
            judge.unmodelled = list(self.structure.unmodelled)
            judge.rotary_at = next(iter(self.structure.rotary.values()), (None, None))[1]
        judge.keys_named_first = self.structure is not None and keys_named_first(self.structure)
        report = judge.run(options)
        spec = judge.spec or options[0][1]
        if report.ok and spec.position_bias is None and spec.multihead:
            self._fail_unread_table(report, spec)
        report.structure = self._structure_report(spec)
        if spec.scale_source == _T5:
            report.notes.append(
                "its scores are not scaled: read as T5's convention beside a learned relative "
                "position bias (the scale folded into the query weights' initialization); a "
                "scale left out by mistake reads the same"
            )
        report.layer = self._layer_path()
        return report

    def _fail_unread_table(self, report: CheckReport, spec: Spec) -> None:
        """A layer judged correct without a position bias that holds a per-head table its
        output does not depend on (an ``nn.Embedding`` of one value per head: a learned
        relative position bias, T5's buckets), or is handed a learned bias it drops: the
        bias built and never added (a guard inverted, a model that never
        passes it), ``biased_scores``/``bias_missing``. A model's layer is asked only of what
        the model hands it (the model may hand it a bias made from another layer's table)."""
        if spec.num_heads < 2:
            return
        detail = None
        if self.host is not None:
            # a bias the model made from its parameters and hands the layer, which its
            # output does not depend on (an SDPA branch that builds its mask without it)
            n = self.calls[0].x.shape[1]
            learned = self.host.learned_arguments(self.entry.module, BATCH, n)
            for key, t in self.entry.extras.items():
                if key in learned and t.shape[-2:] == (n, n) and not self._reads_argument(key):
                    detail = (
                        f"no position bias added, though the model hands the layer a learned "
                        f"one ({key!r}, {tuple(t.shape)}) that its output does not depend on"
                    )
                    break
        else:
            # an embedding of one value per head (a bucket's or an offset's bias per head),
            # the layer's or the target's (a wrapper keeps the table beside its block); not
            # any parameter of that width (talking heads' (heads, heads) map, unused in a
            # layer built without them, is none)
            m = self.entry.module if self.entry is not None else self.module
            held = {
                id(e): (n, e)
                for mod in (self.module, m)
                for n, e in mod.named_modules()
                if isinstance(e, nn.Embedding) and e.embedding_dim == spec.num_heads
            }
            for name, e in held.values():
                if e.num_embeddings > 1 and not self._reads_tensor(e.weight):
                    detail = (
                        f"no position bias added, though the layer holds a learned table of one "
                        f"value per head ({name!r}, an embedding of {e.num_embeddings}: a "
                        "relative position bias) that its output does not depend on"
                    )
                    break
        if detail is not None:
            # the walk up to the scaled scores, then the bias that is not there
            after = (Stage.MASKED_SCORES, Stage.WEIGHTS, Stage.CONTEXT, Stage.OUTPUT)
            checks = [c for c in report.checks if c.stage not in after]
            shape = next((c.predicted for c in checks if c.stage == Stage.SCALED_SCORES), None)
            checks.append(StageCheck(Stage.BIASED_SCORES, False, detail, predicted=shape))
            report.ok, report.checks = False, checks
            report.first_failure = Failure(
                Stage.BIASED_SCORES,
                "bias_missing",
                f"biased_scores: {detail}. Expected the layer's learned relative position "
                "bias added to every score",
            )

    def _longer_length(self) -> int | None:
        """The length a layer judged correct is checked at once more (see
        :meth:`.Judge._longer_probe`): a standalone layer that takes any length; not a
        layer inside a model, whose other arguments are made for the model's length."""
        if self.host is not None or self.cross or self.fixed_tokens is not None:
            return None
        if self.entry is not None and self.entry.grid is not None:
            return None  # tokens laid out as a grid of the probe's shape
        limit = self._context_limit()
        return _WINDOW_PROBE if limit is None else min(_WINDOW_PROBE, limit)

    def _layer_path(self) -> str | None:
        """The layer's dotted path: the module the probe enters, or the module that owns every
        weight the attention uses (the smallest holding them all, above a single projection)
        where the wrapper calls that one by ``.forward()``, which no record sees
        (pytorch-llama's blocks, BERT4Rec's sublayer around it)."""
        st = self.structure
        if self.entry is None:
            # the target computed the attention itself, perhaps through a method of a
            # submodule it never calls (llama.cpp's ``layer.build_attn``): that submodule,
            # where it owns every weight the attention uses
            owner = self._weights_owner() if st is not None and self.host is None else ""
            return owner or None
        path = self.entry.path
        if st is None or self.host is not None:
            return path
        owner = self._weights_owner()
        if not owner or owner == path or path.startswith(owner + "."):
            return path  # the entry itself, or a module inside the owner
        return owner

    def _weights_owner(self) -> str:
        """The smallest module holding every weight the attention uses, above a single
        projection and a list of them; '' for the target itself."""
        st = self.structure
        names = [n for ps in st.roles.values() for p in ps for n in p.params]
        names += list(st.out.params) if st.out is not None else []
        owners = {n.rsplit(".", 1)[0] for n in names if "." in n}
        if not owners or (self.entry is None and any("." not in n for n in names)):
            return ""  # (the target computing it: some weight is its own)
        common = os.path.commonprefix([o.split(".") for o in owners])
        if ".".join(common) in owners:  # one projection holds them all: its parent
            common = common[:-1]
        while common and isinstance(
            self.module.get_submodule(".".join(common)), (nn.ModuleList, nn.ModuleDict)
        ):
            common = common[:-1]  # a list of projections is held by the layer
        return ".".join(common)


@contextlib.contextmanager
def _locals_at_return():
    """The tensors held in local variables of the target's own Python frames when they
    return, with ``file:line`` of the return: what a run built outside torch's calls.
    Yields a list that fills while the block runs."""
    found: list[tuple[str, torch.Tensor]] = []
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)), "<")
    previous = sys.getprofile()

    def hook(frame, event, arg):
        path = frame.f_code.co_filename
        if event != "return" or path.startswith(skip) or "site-packages" in path:
            return
        for name, value in frame.f_locals.items():
            if isinstance(value, torch.Tensor):
                found.append((f"{short_path(path)}:{frame.f_lineno} ({name})", value))

    sys.setprofile(hook)
    try:
        yield found
    finally:
        sys.setprofile(previous)
