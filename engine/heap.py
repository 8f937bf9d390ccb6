"""Handing the C heap's free pages back to the operating system before a large allocation.

glibc's malloc serves buffers below its mmap threshold (up to 32 MB once tuned by use) from the heap,
and freeing them keeps the pages: the heap grows to the largest working set a prefill had (its
layers' transient buffers) and stays that size. A buffer above the threshold (every position's
logits of a prefill) is a fresh mapping on top of it, and the two add up at the process's peak
although they are never live together; so do the compiler's imports and work on top of a heap a
prefill left behind. `release_free_heap()` returns the heap's free pages first (`malloc_trim(0)`):
one call, where a fixed `MALLOC_MMAP_THRESHOLD_` would map and fault in every large buffer of the
prefill afresh and slow it down (figures in docs/benchmarks.md, 'The CPU engine against llama.cpp').

Elsewhere than glibc (macOS, musl, Windows) there is nothing to call and it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable

# an allocation at least this large is worth a trim before it; below it the trim's own cost is not repaid
LARGE_ALLOCATION_BYTES = 64 << 20

_UNRESOLVED = object()
_malloc_trim: Callable[[int], int] | None | object = _UNRESOLVED


def _resolve() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own C library (glibc; musl has none)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS; True when the C library has a way to (glibc)."""
    global _malloc_trim
    if _malloc_trim is _UNRESOLVED:
        _malloc_trim = _resolve()
    if _malloc_trim is None:
        return False
    _malloc_trim(0)  # type: ignore[operator]
    return True
