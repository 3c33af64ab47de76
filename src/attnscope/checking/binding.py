"""Find a module's query, key, value and output weights, whatever their names and layout.

Conventions found without help: separate ``W_query``/``W_key``/``W_value`` as
``nn.Parameter`` ``(d_in, d_out)`` or ``nn.Linear`` ``(out, in)``; ``q_proj``/``wq``/
``to_q``/``query`` names; one combined qkv weight (``nn.Linear``, ``in_proj_weight`` of
``nn.MultiheadAttention``, the transposed ``Conv1D`` of GPT-2); biases; output projections
(``out_proj``, ``c_proj``, ``proj``, ``o_proj``, ...); per-head submodules whose outputs are
concatenated. Where a layout is ambiguous (a square raw matrix), every reading is kept as a
candidate and the checker picks the one the module's own computation confirms.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AttnScopeError
from .reference import Weights

__all__ = ["Binding", "bind", "HEAD_ATTRS", "WEIGHT_HELP"]

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

WEIGHT_HELP = (
    "name them with --weights query=NAME,key=NAME,value=NAME[,out=NAME] (or qkv=NAME for one "
    "combined weight, kv=NAME for a combined key/value one), where NAME is a parameter or "
    "submodule path such as W_query or attn.q_proj"
)

_ROLE_ALIASES = {
    "q": {"q", "query", "queries", "qs"},
    "k": {"k", "key", "keys", "ks"},
    "v": {"v", "value", "values", "vs"},
    "qkv": {"qkv", "c_attn", "in_proj", "qkv_proj", "query_key_value", "kqv", "att_proj"},
    "kv": {"kv", "kv_proj", "key_value", "wkv"},
    "o": {"o", "out", "output", "c_proj", "proj", "dense", "fc_out", "projection", "out_proj"},
}
_PREFIXES = ("w_", "to_", "linear_", "lin_", "proj_", "w")
_SUFFIXES = (
    "_proj",
    "_projection",
    "_linear",
    "_lin",
    "_layer",
    "_weight",
    "_weights",
    "_w",
    "_matrix",
    "_mat",
    "_fc",
    "_dense",
    "_net",
    "_map",
)


def role_of(name: str) -> str | None:
    """The role a parameter or submodule name suggests: q, k, v, qkv, o, or None."""
    n = name.lower()
    candidates = {n}
    for _ in range(2):
        for c in list(candidates):
            for p in _PREFIXES:
                if c.startswith(p) and len(c) > len(p):
                    candidates.add(c[len(p) :])
            for s in _SUFFIXES:
                if c.endswith(s) and len(c) > len(s):
                    candidates.add(c[: -len(s)])
    for role in ("qkv", "kv", "q", "k", "v", "o"):
        if candidates & _ROLE_ALIASES[role]:
            return role
    if re.search(r"qkv|c_attn|in_proj", n):
        return "qkv"
    return None


@dataclass
class RawWeight:
    """A bare weight parameter with its sibling bias (``in_proj_weight`` + ``in_proj_bias``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class ListWeight:
    """Per-head projections in an ``nn.ModuleList`` (``qs = [Linear, ...]``), concatenated."""

    modules: list[nn.Module]


@dataclass
class Readings:
    """The possible ``x @ W + b`` readings of one weight: ``[(W (d_in, d_out), b), ...]``."""

    options: list[tuple[torch.Tensor, torch.Tensor | None]]
    where: str


def _readings(obj: object, where: str, d_in: int | None) -> Readings:
    """Read a module or parameter as a projection, keeping every plausible orientation."""
    f64 = torch.float64
    if isinstance(obj, nn.Linear):
        b = None if obj.bias is None else obj.bias.detach().to(f64)
        return Readings([(obj.weight.detach().to(f64).T, b)], where)
    if type(obj).__name__ == "Conv1D" and hasattr(obj, "weight"):  # GPT-2: weight (in, out)
        b = None if getattr(obj, "bias", None) is None else obj.bias.detach().to(f64)
        return Readings([(obj.weight.detach().to(f64), b)], where)
    if isinstance(obj, ListWeight):
        each = [_readings(m, where, d_in).options[0] for m in obj.modules]
        w = torch.cat([e[0] for e in each], dim=1)
        bs = [e[1] for e in each]
        b = None if any(x is None for x in bs) else torch.cat(bs)
        return Readings([(w, b)], where)
    bias = None
    if isinstance(obj, RawWeight):
        obj, bias = obj.weight, None if obj.bias is None else obj.bias.detach().to(f64)
        if obj.dim() == 3:
            return _per_head_readings(obj.detach().to(f64), bias, where, d_in)
    if isinstance(obj, nn.Module):
        weight = getattr(obj, "weight", None)
        bias = getattr(obj, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise AttnScopeError(f"{where}: expected a Linear-like module or a weight tensor")
        bias = bias.detach().to(f64) if isinstance(bias, torch.Tensor) else None
    else:
        weight = obj
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise AttnScopeError(f"{where}: expected a 2-D weight, got {type(weight).__name__}")
    w = weight.detach().to(f64)
    rows, cols = w.shape
    options = []
    if d_in is None or rows == d_in:
        options.append((w, bias))  # stored (in, out), applied as x @ W
    if d_in is None or cols == d_in:
        options.append((w.T, bias))  # stored (out, in), applied with F.linear
    options = [(m, b) for m, b in options if b is None or b.shape[-1] == m.shape[1]]
    if not options:
        raise AttnScopeError(
            f"{where}: a weight of shape {tuple(w.shape)} does not take d_in={d_in}"
        )
    return Readings(options, where)


def _per_head_readings(w: torch.Tensor, bias, where: str, d_in: int | None) -> Readings:
    """A heads-first weight: ``(H, d_in, head_dim)`` (x @ W per head) or ``(H, head_dim,
    d_in)`` (F.linear per head), read as one ``(d_in, H * head_dim)`` projection."""
    h, a, b = w.shape
    b_flat = None if bias is None else bias.reshape(-1)
    options = []
    if d_in is None or a == d_in:
        options.append((w.permute(1, 0, 2).reshape(a, h * b), b_flat))
    if d_in is None or b == d_in:
        options.append((w.permute(2, 0, 1).reshape(b, h * a), b_flat))
    options = [(m, bb) for m, bb in options if bb is None or bb.shape[-1] == m.shape[1]]
    if not options:
        raise AttnScopeError(
            f"{where}: a weight of shape {tuple(w.shape)} does not take d_in={d_in}"
        )
    return Readings(options, where)


def _bias_role(name: str) -> str | None:
    """The role of a bias parameter: ``q_b``, ``b_q``, ``bq``, ``query_bias``, ``bias_k``..."""
    n = name.lower()
    for affix in ("_bias", "_b"):
        if n.endswith(affix):
            return role_of(n[: -len(affix)])
    for affix in ("bias_", "b_", "b"):
        if n.startswith(affix) and len(n) > len(affix):
            return role_of(n[len(affix) :])
    return None


@dataclass
class Binding:
    """What was found: candidate weight readings, heads, and where they came from."""

    candidates: list[Weights]
    num_heads: int | None
    d_in: int
    d_out: int
    has_out: bool
    source: str


def _find_heads(module: nn.Module) -> int | None:
    for attr in HEAD_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _named_parts(module: nn.Module) -> dict[str, object]:
    """Submodules with a 2-D weight, and raw 2-D parameters, by dotted name (shallow first)."""
    parts: dict[str, object] = {}
    for name, sub in module.named_modules():
        if not name or name.count(".") > 1:
            continue
        w = getattr(sub, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            parts[name] = sub
    params = dict(module.named_parameters())
    for name, sub in module.named_children():
        if (
            isinstance(sub, nn.ModuleList)
            and len(sub)
            and all(isinstance(getattr(m, "weight", None), torch.Tensor) for m in sub)
        ):
            parts[name] = ListWeight(list(sub))
    for name, p in params.items():
        if p.dim() not in (2, 3) or name.count(".") > 1:
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if owner in parts or owner.split(".")[0] in parts:
            continue
        bias = params.get(name.replace("weight", "bias")) if "weight" in name else None
        parts[name] = RawWeight(p, bias if bias is not None and bias.dim() == 1 else None)
    return parts


def _resolve(module: nn.Module, path: str) -> object:
    try:
        return module.get_submodule(path)
    except AttributeError:
        pass
    try:
        return module.get_parameter(path)
    except AttributeError:
        pass
    obj = getattr(module, path, None)
    if isinstance(obj, torch.Tensor):
        return obj
    names = ", ".join(n for n, _ in module.named_parameters())
    raise AttnScopeError(
        f"--weights: expected a parameter or submodule path, got {path!r}; the module has: {names}"
    )


def _split_qkv(w: torch.Tensor, b: torch.Tensor | None, heads: int | None):
    """Cut a combined ``(d_in, 3*d_out)`` reading into q, k, v; two layouts."""
    d3 = w.shape[1]
    if d3 % 3:
        return []
    d = d3 // 3
    layouts = [("[q|k|v]", [slice(i * d, (i + 1) * d) for i in range(3)])]
    out = []
    for name, cuts in layouts:
        parts = [(w[:, c], None if b is None else b[c]) for c in cuts]
        out.append((name, parts))
    if heads and heads > 1 and d % heads == 0:  # per head [q_h|k_h|v_h] (Megatron style)
        hd = d // heads
        idx = torch.arange(d3).view(heads, 3, hd)
        parts = [
            (w[:, idx[:, i].reshape(-1)], None if b is None else b[idx[:, i].reshape(-1)])
            for i in range(3)
        ]
        out.append(("per-head [q|k|v]", parts))
    return out


def bind(module: nn.Module, names: dict[str, str] | None = None) -> Binding:
    """Find the projection weights of ``module``; raise with :data:`WEIGHT_HELP` if none."""
    heads = _find_heads(module)
    if isinstance(module, nn.MultiheadAttention):
        return _bind_torch_mha(module)
    if names:
        parts = {role: _resolve(module, path) for role, path in _normalise_names(names).items()}
        where = {role: names_path for role, names_path in _normalise_names(names).items()}
    else:
        per_head = _bind_per_head(module)
        if per_head is not None:
            return per_head
        inner = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]
        if len(inner) == 1:  # a layer wrapping torch's own
            found = _bind_torch_mha(inner[0][1])
            found.source = f"{inner[0][0]}: {found.source}"
            return found
        parts, where = {}, {}
        for name, obj in _named_parts(module).items():
            role = role_of(name.rsplit(".", 1)[-1])
            head, _, last = name.rpartition(".")
            if role is None and last.isdigit() and last == "0" and head:
                # "to_out.0": a Linear first in a Sequential is named by its container
                container = module.get_submodule(head)
                role = role_of(head) if isinstance(container, nn.Sequential) else None
            if role and role not in parts:
                parts[role], where[role] = obj, name
        _attach_biases(module, parts)
    return _assemble(module, parts, where, heads)


def _attach_biases(module: nn.Module, parts: dict[str, object]) -> None:
    """Give bare weight parameters the bare bias parameters their names pair them with."""
    for name, p in module.named_parameters():
        if p.dim() != 1 or name.count(".") > 1:
            continue
        role = _bias_role(name.rsplit(".", 1)[-1])
        part = parts.get(role)
        if isinstance(part, RawWeight) and part.bias is None:
            parts[role] = RawWeight(part.weight, p)


def _normalise_names(names: dict[str, str]) -> dict[str, str]:
    out = {}
    for key, path in names.items():
        role = {"query": "q", "key": "k", "value": "v", "out": "o", "output": "o"}.get(key, key)
        if role not in ("q", "k", "v", "qkv", "kv", "o"):
            raise AttnScopeError(
                f"--weights: expected roles query, key, value, qkv, kv, out; got {key!r}"
            )
        out[role] = path
    return out


def _assemble(module, parts, where, heads) -> Binding:
    if heads is None and isinstance(parts.get("q"), ListWeight):
        heads = len(parts["q"].modules)  # one projection per head
    stacked = parts.get("qkv")
    if (
        isinstance(stacked, RawWeight)
        and stacked.weight.dim() == 3
        and stacked.weight.shape[0] == 3
    ):
        # (3, d_in, d_out): queries, keys, values stacked on the first axis
        for i, role in enumerate(("q", "k", "v")):
            b = None if stacked.bias is None else stacked.bias.reshape(3, -1)[i]
            parts[role], where[role] = RawWeight(stacked.weight[i], b), f"{where['qkv']}[{i}]"
    if heads is None and isinstance(parts.get("q"), RawWeight) and parts["q"].weight.dim() == 3:
        heads = parts["q"].weight.shape[0]  # heads-first (H, d_in, head_dim)
    if "qkv" in parts and not {"q", "k", "v"} <= parts.keys():
        readings = _readings(parts["qkv"], where["qkv"], None)
        triples = []
        for w, b in readings.options:
            for layout, qkv in _split_qkv(w, b, heads):
                triples.append((qkv, f"{where['qkv']} {layout}"))
        if not triples:
            raise AttnScopeError(
                f"{where['qkv']}: expected a combined weight with 3*d_out outputs; {WEIGHT_HELP}"
            )
        d_in = triples[0][0][0][0].shape[0]
    elif "kv" in parts and "q" in parts and not {"k", "v"} <= parts.keys():
        # a separate query projection and one combined key/value weight (x-transformers)
        q_readings = _readings(parts["q"], where["q"], None)
        triples = []
        for wq, bq in q_readings.options:
            for wkv, bkv in _readings(parts["kv"], where["kv"], wq.shape[0]).options:
                d = wkv.shape[1] // 2
                if wkv.shape[1] % 2 or d != wq.shape[1]:
                    continue
                halves = [
                    (wkv[:, :d], None if bkv is None else bkv[:d]),
                    (wkv[:, d:], None if bkv is None else bkv[d:]),
                ]
                triples.append(([(wq, bq), *halves], f"{where['q']}, {where['kv']} [k|v]"))
        if not triples:
            raise AttnScopeError(
                f"{where['kv']}: expected a combined key/value weight with 2*d_out outputs; "
                + WEIGHT_HELP
            )
        d_in = triples[0][0][0][0].shape[0]
    elif {"q", "k", "v"} <= parts.keys():
        first = _readings(parts["q"], where["q"], None)
        d_in_options = {w.shape[0] for w, _ in first.options}
        triples = []
        for d_in in sorted(d_in_options):
            rs = [_readings(parts[r], where[r], d_in) for r in ("q", "k", "v")]
            # a square raw matrix has two readings; the three share one convention
            for pick in range(max(len(r.options) for r in rs)):
                qkv = [r.options[min(pick, len(r.options) - 1)] for r in rs]
                if len({w.shape for w, _ in qkv}) == 1:
                    triples.append((qkv, ", ".join(where[r] for r in ("q", "k", "v"))))
        if not triples:
            raise AttnScopeError(f"query, key and value weights of different shapes; {WEIGHT_HELP}")
        d_in = triples[0][0][0][0].shape[0]
    else:
        found = ", ".join(f"{r}={w}" for r, w in where.items()) or "none"
        names = ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters())
        raise AttnScopeError(
            f"{type(module).__name__}: expected query, key and value weights (found by name: "
            f"{found}; its parameters: {names or 'none'}); " + WEIGHT_HELP
        )
    d_out = triples[0][0][0][0].shape[1]
    outs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)]
    if "o" in parts:
        outs = [(w, b) for w, b in _readings(parts["o"], where["o"], d_out).options]
    candidates = []
    for (qkv, source), (wo, bo) in itertools.product(triples, outs):
        (wq, bq), (wk, bk), (wv, bv) = qkv
        candidates.append(Weights(wq, wk, wv, bq, bk, bv, wo, bo, source=source))
    source = triples[0][1] + (f", out={where['o']}" if "o" in parts else "")
    return Binding(candidates, heads, d_in, d_out, "o" in parts, source)


def _bind_per_head(module: nn.Module) -> Binding | None:
    """Per-head submodules in an ``nn.ModuleList``, outputs concatenated (the book's wrapper)."""
    for name, child in module.named_children():
        if not isinstance(child, nn.ModuleList) or len(child) == 0:
            continue
        try:
            bound = [bind(h) for h in child]
        except AttnScopeError:
            continue
        if any(b.has_out or len(b.candidates) != 1 for b in bound):
            continue
        ws = [b.candidates[0] for b in bound]

        def cat(attr: str, ws: list[Weights] = ws) -> torch.Tensor | None:
            ts = [getattr(w, attr) for w in ws]
            if any(t is None for t in ts):
                return None
            return torch.cat(ts, dim=-1)

        outs = [(None, None)]
        has_out = False
        for cname, sub in module.named_children():
            if cname != name and role_of(cname) == "o":
                d = sum(w.q.shape[1] for w in ws)
                outs = _readings(sub, cname, d).options
                has_out = True
                break
        cands = [
            Weights(
                cat("q"),
                cat("k"),
                cat("v"),
                cat("bq"),
                cat("bk"),
                cat("bv"),
                wo,
                bo,
                source=f"{name}[0..{len(ws) - 1}]",
            )
            for wo, bo in outs
        ]
        d_out = cands[0].q.shape[1]
        return Binding(cands, len(ws), bound[0].d_in, d_out, has_out, f"{len(ws)} heads in {name}")
    return None


def _bind_torch_mha(m: nn.MultiheadAttention) -> Binding:
    f64 = torch.float64
    if m.in_proj_weight is not None:
        w = m.in_proj_weight.detach().to(f64)
        b = None if m.in_proj_bias is None else m.in_proj_bias.detach().to(f64)
        e = m.embed_dim
        qkv = [
            (w[i * e : (i + 1) * e].T, None if b is None else b[i * e : (i + 1) * e])
            for i in range(3)
        ]
    else:
        ws = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        b = None if m.in_proj_bias is None else m.in_proj_bias.detach().to(f64)
        e = m.embed_dim
        qkv = [
            (w.detach().to(f64).T, None if b is None else b[i * e : (i + 1) * e])
            for i, w in enumerate(ws)
        ]
    wo = m.out_proj.weight.detach().to(f64).T
    bo = None if m.out_proj.bias is None else m.out_proj.bias.detach().to(f64)
    (wq, bq), (wk, bk), (wv, bv) = qkv
    weights = Weights(wq, wk, wv, bq, bk, bv, wo, bo, source="in_proj_weight, out_proj")
    return Binding(
        [weights],
        m.num_heads,
        wq.shape[0],
        wq.shape[1],
        True,
        "nn.MultiheadAttention in_proj_weight and out_proj",
    )
