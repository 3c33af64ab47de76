"""Which heads stand out, read from every query's summary (no matrix needed).

A long input has too many queries to read one by one. Each head is averaged over its queries
(the later half of them, where a causal query has keys to choose from) and named when it
does something a reader looks for: a sink (much weight on the first token), a sharp focus
(one key takes most of the weight), a near-uniform spread, a reach far back or only to the
last few tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..trace import Trace

#: what makes a head stand out: (mean over its later queries) thresholds
SINK = 0.3  # weight on token 0
FOCUSED = 0.6  # the largest weight
DIFFUSE = 0.95  # entropy as a share of the uniform spread's, log(visible keys)
FAR = 0.6  # mean distance as a share of the query's position (uniform causal: about 0.5)
NEAR = 0.05  # the same, for heads that look only at the last few tokens


@dataclass
class HeadProfile:
    """One head's summary averaged over its later queries, and why it stands out."""

    head: int | None
    entropy: float
    spread: float  # entropy / log(visible keys): 1 is uniform
    max_weight: float
    sink_weight: float
    mean_distance: float
    reach: float | None  # mean distance / position (causal only)
    notes: list[str]


def _visible(pos: torch.Tensor, keys: int, tokens: int, causal: bool, window: int | None):
    """How many keys each query may see: every key, or (causal) those up to it, at most
    ``window`` of them (a cache before the queries counts as seen)."""
    if not causal:
        return torch.full_like(pos, keys)
    seen = pos + 1 + (keys - tokens)
    return seen.clamp(max=window) if window is not None else seen


def profile_heads(trace: Trace, batch: int = 0) -> list[HeadProfile]:
    """Every head's profile from :attr:`Trace.summary` (one entry, head None, without heads)."""
    s = trace.summary
    if trace.dims.batch is not None:
        s = s.select(batch)
    heads = trace.dims.num_heads
    causal = "masked_scores" in trace
    window = getattr(trace.module, "window", None) if causal else None
    keys = trace.dims.key_tokens or trace.dims.tokens
    pos = s.positions.to(torch.float64)
    later = pos >= pos.max() / 2 if pos.numel() else pos.bool()
    visible = _visible(pos, keys, trace.dims.tokens, causal, window)[later]
    out = []
    for h in range(heads or 1):
        one = s.select(h) if heads else s

        def mean(t: torch.Tensor) -> float:
            return float(t.to(torch.float64)[later].mean())

        logs = torch.log(visible.clamp(min=2))
        spread = float((one.entropy.to(torch.float64)[later] / logs).mean())
        # how far a query could look: its position, or the window's far end
        where = pos[later].clamp(min=1)
        if window is not None:
            where = where.clamp(max=max(1, window - 1))
        reach = (
            float((one.mean_distance.to(torch.float64)[later] / where).mean()) if causal else None
        )
        p = HeadProfile(
            h if heads else None,
            mean(one.entropy),
            spread,
            mean(one.max_weight),
            mean(one.sink_weight),
            mean(one.mean_distance),
            reach,
            [],
        )
        if p.sink_weight >= SINK:
            p.notes.append(f"sink: {p.sink_weight:.0%} of its weight on the first token")
        if p.max_weight >= FOCUSED:
            p.notes.append(f"focused: its largest weight averages {p.max_weight:.2f}")
        elif p.spread >= DIFFUSE:
            p.notes.append(f"diffuse: {p.spread:.0%} of a uniform spread's entropy")
        if reach is not None and reach >= FAR and not math.isnan(reach):
            p.notes.append(f"looks far back: {p.mean_distance:,.1f} tokens on average")
        elif reach is not None and reach <= NEAR and pos.max() >= 8:
            p.notes.append(f"local: {p.mean_distance:.1f} tokens back on average")
        out.append(p)
    return out
