"""attnscope: self-attention for PyTorch that shows its work.

Reference attention from "Build a Large Language Model From Scratch" (simplified, V1, V2,
causal, multi-head) with a fast path; traces of every stage by name; and a checker that
runs anyone's attention code and names the first stage that goes wrong.
"""

from __future__ import annotations

from . import functional, render  # noqa: F401  (render fills the table of renderers)
from ._version import __version__
from .checking import CheckReport, ModelReport, check
from .errors import AttnScopeError
from .examples import BOOK_TOKENS, TOY_TOKENS, book_embeddings, toy_scores
from .grouped import GroupedQueryAttention
from .modules import CausalAttention, MultiHeadAttention, SelfAttentionV1, SelfAttentionV2
from .stages import KINDS, Dims, Stage
from .trace import QueryWalk, Trace, trace

__all__ = [
    "__version__",
    "AttnScopeError",
    "BOOK_TOKENS",
    "CausalAttention",
    "CheckReport",
    "Dims",
    "GroupedQueryAttention",
    "KINDS",
    "ModelReport",
    "MultiHeadAttention",
    "QueryWalk",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "Stage",
    "TOY_TOKENS",
    "Trace",
    "book_embeddings",
    "check",
    "functional",
    "toy_scores",
    "trace",
]
