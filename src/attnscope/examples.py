"""The built-in examples: the book's six embeddings and the seed's three toy scores."""

from __future__ import annotations

import torch

__all__ = ["BOOK_TOKENS", "book_embeddings", "TOY_TOKENS", "toy_scores"]

#: The book's running sentence, one token per word.
BOOK_TOKENS = ("Your", "journey", "starts", "with", "one", "step")

_BOOK_EMBEDDINGS = [
    [0.43, 0.15, 0.89],  # Your     (x^1)
    [0.55, 0.87, 0.66],  # journey  (x^2)
    [0.57, 0.85, 0.64],  # starts   (x^3)
    [0.22, 0.58, 0.33],  # with     (x^4)
    [0.77, 0.25, 0.10],  # one      (x^5)
    [0.05, 0.80, 0.55],  # step     (x^6)
]

#: The seed's toy sentence; "sat" is the query.
TOY_TOKENS = ("cat", "sat", "mat")


def book_embeddings(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 3-dimensional embeddings of "Your journey starts with one step": ``(6, 3)``."""
    return torch.tensor(_BOOK_EMBEDDINGS, dtype=dtype)


def toy_scores(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The seed's raw scores of the query "sat" against "cat", "sat", "mat": ``(3,)`` = 1, 5, 2."""
    return torch.tensor([1.0, 5.0, 2.0], dtype=dtype)
