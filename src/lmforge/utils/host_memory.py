"""Freed host memory kept for reuse while training (glibc's malloc, Linux).

glibc serves a large allocation (above its mmap threshold: 128 KiB, raised adaptively to at most 32
MiB) with a fresh `mmap` and unmaps it on free, and returns free memory at the top of the heap to the
OS beyond 128 KiB (the trim threshold). A training step on a CPU allocates and frees the same
activations, gradients and temporaries every step, so every step pays for them again: a page fault and
a zeroed page per 4 KiB touched. At lmforge's nanochat-size bench model (7.3M parameters, 2,048 tokens
per step) that was ~80,000 minor faults and 14% of the step (`bench/host_memory.py`).

`keep_freed_memory()` turns both off for its duration (`mallopt(M_MMAP_MAX, 0)`: every allocation
comes from the heap; `mallopt(M_TRIM_THRESHOLD, 2 GiB)`: freed memory stays there), so after the first
step the allocator reuses what the last one freed and the step runs without faults. The cost: the
process keeps its peak footprint until the context ends. Then mmap is allowed again and
`malloc_trim(0)` hands the free memory back; since setting any of these ends glibc's adaptive
thresholds for the process, the thresholds are set to where that adaptation ends up in a long-running
process (mmap above 32 MiB, trim above 64 MiB). Elsewhere (another C library, another OS) it does
nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import platform
from collections.abc import Iterator
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt parameters (malloc.h)
# glibc's default mmap count, and its adaptive thresholds' ceiling (64-bit) and the trim threshold that
# goes with it (twice the mmap threshold)
DEFAULT_MMAP_MAX, ADAPTED_MMAP_THRESHOLD, ADAPTED_TRIM_THRESHOLD = 65536, 32 * 2**20, 64 * 2**20
KEEP_TRIM_THRESHOLD = 2**31 - 1  # the largest an int takes: free memory is (in practice) never trimmed

_depth = 0


@cache
def glibc() -> ctypes.CDLL | None:
    """The process's glibc (for mallopt and malloc_trim), or None on any other C library or OS."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@contextlib.contextmanager
def keep_freed_memory(enabled: bool = True) -> Iterator[bool]:
    """Inside: host allocations never mmap and freed memory is never trimmed (see the module). Yields
    whether it took effect (False when disabled or not on glibc). Nested uses share the outermost."""
    global _depth
    libc = glibc() if enabled else None
    if libc is None:
        yield False
        return
    if _depth == 0:
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)
    _depth += 1
    try:
        yield True
    finally:
        _depth -= 1
        if _depth == 0:
            libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
            libc.mallopt(M_MMAP_THRESHOLD, ADAPTED_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, ADAPTED_TRIM_THRESHOLD)
            libc.malloc_trim(0)
