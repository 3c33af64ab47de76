"""ALiBi, read back from the bias a layer adds to its scores.

The reference adds the standard bias, ``slope_h * (j - i)`` with the geometric slopes for
the layer's head count (:func:`attnscope.functional.alibi_slopes`); a layer that adds its
bias before the scale (Falcon) is held to the same slopes added there. What the layer
added is kept as seen: its slopes, read per head as the step from one key to the next, name
the mistake when they are not the standard ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..functional import alibi_slopes

__all__ = ["Alibi", "read_slopes", "alibi_bias", "is_symmetric"]

T = torch.Tensor


def alibi_bias(slopes: T, n: int, symmetric: bool = False) -> T:
    """``(H, n, n)``: ``slope_h * (j - i)``, 0 on the diagonal, more negative further back
    (equal, per query row, to BLOOM's ``slope_h * j``: a constant a softmax ignores), or
    with ``symmetric`` ``-slope_h * |i - j|`` (both the same where a causal mask hides
    ``j > i``; bidirectional layers use either)."""
    pos = torch.arange(n, dtype=torch.float64)
    d = pos[None, None, :] - pos[None, :, None]
    return slopes.to(torch.float64)[:, None, None] * (-d.abs() if symmetric else d)


@dataclass(eq=False)
class Alibi:
    """The reference's position bias: the standard slopes for ``heads``; ``before_scale``
    when the layer adds it before scaling the scores; ``seen``: the slopes the layer used."""

    heads: int
    before_scale: bool = False
    seen: T | None = None
    symmetric: bool = False  # -slope * |i - j| (a bidirectional layer's choice)

    @property
    def slopes(self) -> T:
        return alibi_slopes(self.heads)

    def bias(self, heads: int, n: int) -> T:
        return alibi_bias(self.slopes, n, self.symmetric)


def read_slopes(tensor: T, scores_shape: tuple[int, ...], heads: int) -> T | None:
    """Per head, the step the bias takes from one key to the next before the query,
    ``(H,)``; None when the tensor cannot be read per head."""
    try:
        e = tensor.detach().to(torch.float64).expand(scores_shape)
    except RuntimeError:
        return None
    n_k = e.shape[-1]
    if e.numel() % (heads * n_k * e.shape[-2]):
        return None
    e = e.reshape(-1, heads, e.shape[-2], n_k)  # (B, H, T_q, T_k)
    d = e[..., 1:] - e[..., :-1]  # step from key j to j + 1
    n_q = e.shape[-2]
    before = torch.ones(n_q, n_k - 1, dtype=torch.bool).tril(n_k - n_q - 1)  # j + 1 <= i
    ok = torch.isfinite(d) & (e[..., 1:] > -1e4) & (e[..., :-1] > -1e4) & before
    slopes = []
    for h in range(heads):
        steps = d[:, h][ok[:, h]]
        if steps.numel() == 0:
            return None
        slopes.append(steps.median())
    return torch.stack(slopes)


def is_symmetric(tensor: T, scores_shape: tuple[int, ...]) -> bool:
    """Whether the bias falls off after the query as it does before it (``-|i - j|``)."""
    try:
        e = tensor.detach().to(torch.float64).expand(scores_shape)
    except RuntimeError:
        return False
    n_q, n_k = e.shape[-2], e.shape[-1]
    if n_q != n_k or n_q < 3:
        return False
    e = e.reshape(-1, n_q, n_k)[0]
    finite = torch.isfinite(e) & (e > -1e4)
    if not bool(finite.triu(1).any()):
        return False  # the future is masked away: either form
    centred = e - e.diagonal()[:, None]
    both = finite & finite.T
    return bool(torch.allclose(centred[both], centred.T[both], atol=1e-5))
