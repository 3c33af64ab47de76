"""Attention as small, pure functions, one per stage.

:mod:`.core` is the book's pipeline (scores, scaling, masks, softmax, context, heads);
:mod:`.variants` adds what modern layers do on the way (rotary embeddings, grouped
key/value heads, QK norm, sliding windows, ALiBi); :mod:`.blocked` computes the core over
blocks of keys in linear memory (long sequences), with a summary of every query's weights;
:mod:`.pooled` pools a large matrix stage into a picture-sized one, block by block.
Everything is importable from here: ``attnscope.functional.apply_rope``.
"""

from __future__ import annotations

from .blocked import *  # noqa: F403
from .blocked import __all__ as _blocked
from .core import *  # noqa: F403
from .core import Record
from .core import __all__ as _core
from .pooled import *  # noqa: F403
from .pooled import POOLABLE
from .pooled import __all__ as _pooled
from .variants import *  # noqa: F403
from .variants import __all__ as _variants

__all__ = ["Record", "POOLABLE", *_core, *_variants, *_blocked, *_pooled]
