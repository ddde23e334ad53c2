"""Keeping the C allocator from holding freed memory of big structures (glibc only; a no-op elsewhere).

glibc serves allocations of at least ``M_MMAP_THRESHOLD`` (128 KiB at start) with their own mappings, which
go back to the system on free. But each free of such a mapping raises the threshold to that block's size (up
to 32 MiB), so after the first large dict resize or array reallocation, the next big tables and column
buffers come from the main heap instead; every later resize then leaves the old table behind as a hole the
heap cannot return. Measured through ``kvagent serve`` at 1M resident blocks (docs/performance.md): 245 B
of RSS per block with the moving threshold, 200–218 B with it fixed at its initial 128 KiB.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["MMAP_THRESHOLD", "keep_large_allocations_mapped"]

MMAP_THRESHOLD = 128 * 1024  # glibc's own initial value: only its upward drift is disabled
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def keep_large_allocations_mapped(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True when set (False: not glibc, nothing done).

    Fixing it also stops glibc from raising its heap trim threshold, so freed memory at the heap's top is
    returned sooner.  Call once at process start, before the big structures grow.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  # present only in glibc, whose mallopt this tunes
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
