"""What modern layers add to the book's pipeline, one small function each.

Rotary position embeddings (both pairings, a rotated fraction, any base, a position
offset), grouped key/value heads, QK norm, sliding-window masks and ALiBi biases: the
pieces of Llama, Mistral, Qwen, Gemma, GPT-NeoX and BLOOM attention. Shapes: ``B`` batch,
``H`` query heads, ``K`` key/value heads, ``T`` tokens, ``D`` head_dim.
"""

from __future__ import annotations

import math

import torch

from ..errors import AttnScopeError, check_tensor, describe

__all__ = [
    "PAIRINGS",
    "rope_frequencies",
    "rope_angles",
    "rotary_dims",
    "apply_rope",
    "rotate_pairs",
    "repeat_kv",
    "kv_head_of",
    "rms_norm",
    "sliding_window_mask",
    "alibi_slopes",
    "alibi_bias",
]

#: How a rotary embedding pairs features: ``half`` rotates feature i with i + D/2 (Hugging
#: Face's ``rotate_half``, the book's ``apply_rope``); ``interleaved`` rotates 2i with 2i+1
#: (Meta's complex-number code, GPT-J).
PAIRINGS = ("half", "interleaved")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AttnScopeError(f"{name}: expected a positive integer, got {describe(value)}")
    return value


def rotary_dims(head_dim: int, fraction: float = 1.0) -> int:
    """How many features of each head are rotated: ``head_dim * fraction``, made even.

    GPT-NeoX's ``rotary_pct=0.25`` rotates the first quarter and passes the rest through.
    """
    _positive_int("head_dim", head_dim)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not (0 < fraction <= 1)
    ):
        raise AttnScopeError(f"fraction: expected a number in (0, 1], got {describe(fraction)}")
    rot = int(head_dim * fraction) // 2 * 2
    if rot == 0:
        raise AttnScopeError(
            f"fraction: expected at least one rotated pair of head_dim={head_dim}, "
            f"got fraction={fraction}"
        )
    return rot


def rope_frequencies(head_dim: int, base: float = 10_000.0, fraction: float = 1.0) -> torch.Tensor:
    """``(R/2,)`` the inverse frequencies ``base ** (-2i / R)``, ``R`` the rotated features.

    Pair ``i`` turns by ``position * freq[i]`` radians: fast for the first pairs, slow for the
    last. Scaled schemes (Llama 3's) are other frequencies: pass them to :func:`rope_angles`.
    """
    if isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 1:
        raise AttnScopeError(f"base: expected a number above 1, got {describe(base)}")
    rot = rotary_dims(head_dim, fraction)
    return 1.0 / (float(base) ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))


def rope_angles(
    tokens: int, frequencies: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """``(T, R/2)`` the angle of every rotated pair at positions ``offset .. offset + T - 1``.

    ``positions`` ``(T,)`` replaces that range (a cache, or packed sequences).
    """
    _positive_int("tokens", tokens)
    if positions is None:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise AttnScopeError(f"offset: expected a non-negative integer, got {describe(offset)}")
        positions = torch.arange(offset, offset + tokens, dtype=torch.float64)
    elif positions.shape != (tokens,):
        raise AttnScopeError(f"positions: expected shape ({tokens},), got {describe(positions)}")
    return positions.to(torch.float64)[:, None] * frequencies.to(torch.float64)[None, :]


def apply_rope(
    x: torch.Tensor,
    angles: torch.Tensor,
    pairing: str = "half",
) -> torch.Tensor:
    """Rotate each pair of features of ``x`` by its angle: the rotary position embedding.

    Args:
        x: ``(..., T, D)`` queries or keys, per head.
        angles: ``(T, R/2)`` from :func:`rope_angles`; the first ``R`` features of each head
            are rotated, the other ``D - R`` pass through (a partial rotation).
        pairing: ``"half"`` (feature i with i + R/2) or ``"interleaved"`` (2i with 2i+1).

    Returns:
        ``(..., T, D)``, in ``x``'s dtype. A rotation: every pair keeps its length, and the
        dot product of a query at position m with a key at n depends on m - n only.
    """
    x = check_tensor(x, name="x", ranks=(2, 3, 4), finite=False)
    if pairing not in PAIRINGS:
        raise AttnScopeError(f"pairing: expected one of {', '.join(PAIRINGS)}, got {pairing!r}")
    t, d = x.shape[-2], x.shape[-1]
    if angles.dim() != 2 or angles.shape[0] != t or 2 * angles.shape[1] > d:
        raise AttnScopeError(
            f"angles: expected ({t}, at most {d // 2}) for x {tuple(x.shape)}, "
            f"got {describe(angles)}"
        )
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return rotate_pairs(x, cos.to(x.device), sin.to(x.device), pairing)


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str
) -> torch.Tensor:
    """:func:`apply_rope` from its tables: ``cos``, ``sin`` ``(T, R/2)`` in ``x``'s dtype.

    No checks: for a module's fast path, whose tables are made (and checked) once.
    """
    rot = 2 * cos.shape[-1]
    part, rest = x[..., :rot], x[..., rot:]
    if pairing == "half":
        first, second = part[..., : rot // 2], part[..., rot // 2 :]
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    else:
        even, odd = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
        rotated = rotated.flatten(-2)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


def kv_head_of(head: int, heads: int, kv_heads: int) -> int:
    """The key/value head query head ``head`` reads: ``head // (heads / kv_heads)``.

    The convention of every published grouped-query checkpoint (Llama, Mistral, Qwen):
    consecutive query heads share a key/value head.
    """
    return head // (heads // kv_heads)


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``(B, K, T, D) -> (B, K * group, T, D)``: each key/value head repeated for its group.

    Head ``k`` becomes heads ``k * group .. k * group + group - 1`` (``repeat_interleave``,
    not ``repeat``: see :func:`kv_head_of`). ``group=1`` returns ``x`` itself.
    """
    x = check_tensor(x, name="x", ranks=(3, 4), finite=False)
    _positive_int("group", group)
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``.

    The QK norm of Qwen 3 and Gemma 3 (per head, over ``D``) and OLMo 2 (over the whole
    projection, before the heads are split). Computed in float32 at least, as they do.
    """
    x = check_tensor(x, name="x", ranks=(1, 2, 3, 4), finite=False)
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.to(normed.dtype)
    return normed.to(x.dtype)


def sliding_window_mask(
    tokens: int,
    window: int,
    key_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``(T, T_k)`` bool, ``True`` where hidden: the future, and keys ``window`` or more back.

    Query ``i`` sees keys ``i - window + 1 .. i``: ``window`` keys, itself included (Mistral's
    ``sliding_window``). With ``key_tokens > T`` the queries are the last ``T`` positions (a
    cache before them).
    """
    _positive_int("tokens", tokens)
    _positive_int("window", window)
    t_k = tokens if key_tokens is None else _positive_int("key_tokens", key_tokens)
    q = torch.arange(t_k - tokens, t_k, device=device)[:, None]
    k = torch.arange(t_k, device=device)[None, :]
    return (k > q) | (q - k >= window)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """``(H,)`` ALiBi's head slopes: the geometric sequence ``2^(-8/n), 2^(-16/n), ...``.

    For a head count that is not a power of two, the slopes of the nearest power below,
    then every other slope of twice that (the paper's and BLOOM's rule).
    """
    _positive_int("num_heads", num_heads)

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    low = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = powers(low)
    if low < num_heads:
        slopes += powers(2 * low)[0::2][: num_heads - low]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(slopes: torch.Tensor, tokens: int, key_tokens: int | None = None) -> torch.Tensor:
    """``(H, T, T_k)`` ALiBi's additive bias: ``-slope * distance`` between query and key.

    Added to the scaled scores, it favours near keys; with ``key_tokens > T`` the queries are
    the last ``T`` positions. (BLOOM adds ``slope * key_position``, which differs by a
    constant per row: the same weights after the softmax.)
    """
    _positive_int("tokens", tokens)
    t_k = tokens if key_tokens is None else _positive_int("key_tokens", key_tokens)
    q = torch.arange(t_k - tokens, t_k, dtype=torch.float64)[:, None]
    k = torch.arange(t_k, dtype=torch.float64)[None, :]
    return -slopes.to(torch.float64)[:, None, None] * (q - k).abs()
