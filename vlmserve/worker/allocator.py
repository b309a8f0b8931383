"""Keeps freed memory in the process for the next step.

glibc serves large allocations (over 128 KB, then a threshold it raises up to 32 MB as
it sees them freed) with mmap and gives them back with munmap, and trims the top of its
heap when 128 KB are free there. An engine step allocates and frees the same large
temporaries every step (activations, logits, attention scratch), so with the defaults
each step maps fresh pages and faults them in again: on the peer benchmark's workload
the process spent 11 s of 30 s CPU in the kernel, and ran at 500 tok/s. With large
allocations kept in the heap and the heap never trimmed, sys time fell to under 1 s and
throughput rose to 740 tok/s (GLIBC_TUNABLES with the same values gave the same). The
price: the process keeps its peak heap (RSS does not shrink after a burst).
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # the heap top is never given back (the largest int mallopt takes)
_done = False


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds once per process; False where there is no glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    if not ok:
        logger.warning("glibc refused the allocator thresholds: large temporaries will be mapped every step")
    _done = ok
    return ok
