"""How a worker process's C heap treats the memory of the samples it frees after every batch.

A worker makes a batch's samples (a decoded image is a fresh tensor of a few hundred KiB),
stacks them into a slab, and frees them all at once. With glibc's default settings, what
happens next is left to chance. Allocations above the mmap threshold (128 KiB at first) are
served by their own ``mmap``; freeing one raises that threshold to its size and the trim
threshold to twice that, so later samples come from the heap. When a whole batch's samples are
freed, they coalesce into one free block at the top of the heap, far above the trim threshold,
and glibc gives it back to the kernel, unless some small allocation made after them happens to
sit above it and pins it. Where nothing pins it, every batch faults all of its samples' pages
in again, in kernel time that can exceed the batch's whole cost; and whether anything pins it
is decided by the heap's layout when the worker forked, so it differs from run to run
(docs/benchmark-notes.md, "A worker's heap").

Pinning the thresholds makes the good case the only one: allocations up to 32 MiB come from the
heap (where glibc's own adjustment ends up, at its ceiling), and freed memory at the top of
the heap is kept while it is below twice the largest batch seen (at least 64 MiB), which the
next batch will use again. Memory is still returned beyond that, so a worker that once
made a huge transient allocation does not keep all of it.

Only glibc has ``mallopt``'s settings, and a user who has tuned malloc (``MALLOC_*_``
variables, or ``glibc.malloc`` tunables) keeps their settings: then this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable

__all__ = ["HeapPolicy"]

# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
_MIN_TRIM_THRESHOLD = 64 << 20
_MAX_TRIM_THRESHOLD = 1 << 30
_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def _mallopt() -> Callable[[int, int], int] | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    if any(name in os.environ for name in _USER_SETTINGS):
        return None
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    setter: Callable[[int, int], int] = mallopt
    return setter


class HeapPolicy:
    """The worker's malloc thresholds, set once at its start and raised as batches grow."""

    def __init__(self) -> None:
        self._mallopt = _mallopt()
        self._trim_threshold = 0
        if self._mallopt is not None:
            self._mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
            self.batch_made(0)

    def batch_made(self, nbytes: int) -> None:
        """A batch of ``nbytes`` was made: keep at least twice that of freed heap memory.
        Cheap when nothing changes (it runs after every batch)."""
        if self._mallopt is None:
            return
        wanted = min(max(_MIN_TRIM_THRESHOLD, 2 * nbytes), _MAX_TRIM_THRESHOLD)
        if wanted > self._trim_threshold:
            self._trim_threshold = wanted
            self._mallopt(_M_TRIM_THRESHOLD, wanted)
