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

__all__ = ["Alibi", "read_slopes", "alibi_bias"]

T = torch.Tensor


def alibi_bias(slopes: T, n: int) -> T:
    """``(H, n, n)``: ``slope_h * (j - i)``, 0 on the diagonal, more negative further back
    (equal, per query row, to BLOOM's ``slope_h * j``: a constant a softmax ignores)."""
    pos = torch.arange(n, dtype=torch.float64)
    return slopes.to(torch.float64)[:, None, None] * (pos[None, None, :] - pos[None, :, None])


@dataclass(eq=False)
class Alibi:
    """The reference's position bias: the standard slopes for ``heads``; ``before_scale``
    when the layer adds it before scaling the scores; ``seen``: the slopes the layer used."""

    heads: int
    before_scale: bool = False
    seen: T | None = None

    @property
    def slopes(self) -> T:
        return alibi_slopes(self.heads)

    def bias(self, heads: int, n: int) -> T:
        return alibi_bias(self.slopes, n)


def read_slopes(tensor: T, scores_shape: tuple[int, ...], heads: int) -> T | None:
    """Per head, the step the bias takes from one key to the next, ``(H,)``; None when the
    tensor cannot be read per head (or does not step evenly)."""
    try:
        e = tensor.detach().to(torch.float64).expand(scores_shape)
    except RuntimeError:
        return None
    n_k = e.shape[-1]
    if e.numel() % (heads * n_k * e.shape[-2]):
        return None
    e = e.reshape(-1, heads, e.shape[-2], n_k)  # (B, H, T_q, T_k)
    d = e[..., 1:] - e[..., :-1]
    ok = torch.isfinite(d) & (e[..., 1:] > -1e4) & (e[..., :-1] > -1e4)
    slopes = []
    for h in range(heads):
        steps = d[:, h][ok[:, h]]
        if steps.numel() == 0:
            return None
        slopes.append(steps.median())
    return torch.stack(slopes)
