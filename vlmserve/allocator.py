"""Keeps freed memory in the process for the next step.

glibc serves large allocations (over 128 KB, then a threshold it raises up to 32 MB as
it sees them freed) with mmap and gives them back with munmap, and trims the top of its
heap when 128 KB are free there. An engine step allocates and frees the same large
temporaries every step (activations, logits, attention scratch), so with the defaults
each step maps fresh pages and faults them in again: on the peer benchmark's workload
the process spent 11 s of 30 s CPU in the kernel, and ran at 500 tok/s. With large
allocations kept in the heap and the heap never trimmed, sys time fell to under 1 s and
throughput rose to 740 tok/s (GLIBC_TUNABLES with the same values gave the same). The
price: the process keeps its peak heap while it works; a server's engine that has gone
idle, and an offline one at the end of its calls, give the freed part back
(`give_back_freed_memory`), so RSS falls after a burst.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # glibc never trims the heap top by itself (the largest int mallopt takes)
GLIBC_TRIM_THRESHOLD = 128 << 10  # glibc's own
IDLE_SECONDS_BEFORE_GIVING_BACK = 2.0  # a chat's next turn, sooner, reuses the kept memory
# re-faulting what a give-back returned costs ~0.2 ms per MB: under 1% of this much work
WORK_SECONDS_BEFORE_GIVING_BACK = 30.0
_done = False
_returning = 0  # work in progress that returns its freed memory (returning_freed_memory)
_returning_lock = threading.Lock()


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds once per process; False where there is no glibc."""
    global _done
    if _done:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not _done:
        logger.warning("glibc refused the allocator thresholds: large temporaries will be mapped every step")
    return _done


def give_back_freed_memory() -> bool:
    """Returns the heap's free pages to the system (glibc's malloc_trim: the top of the heap
    and whole free pages inside it); True if any went back. For an engine gone idle: its
    next step faults them in again, which costs far less than the step."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


@contextmanager
def returning_freed_memory() -> Iterator[None]:
    """For work that frees much memory once (a large picture's decode, on a processing
    thread) in a process that keeps freed memory: while any such work runs, glibc trims
    heaps as their tops are freed, as it does by default, and when the last ends the free
    pages go back. Without it the top of each thread's heap stays (malloc_trim returns
    only the main heap's top): four 64-megapixel decodes on four threads left 236 MB.
    The engine's own temporaries freed meanwhile go back too (faulted in again next step:
    the price of a rare large decode)."""
    global _returning
    libc = _glibc()
    if libc is None:
        yield
        return
    with _returning_lock:
        _returning += 1
        if _returning == 1 and _done:
            libc.mallopt(_M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
    try:
        yield
    finally:
        with _returning_lock:
            _returning -= 1
            if _returning == 0:
                if _done:
                    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                libc.malloc_trim(0)


class IdleMemoryReturn:
    """Gives the freed heap back once an engine loop has been idle a while, once per idle
    spell (the first one starts at start-up)."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS_BEFORE_GIVING_BACK) -> None:
        self.idle_seconds = idle_seconds
        self._last_busy: float | None = time.monotonic()  # None: given back since

    def tick(self, busy: bool) -> None:
        """Called by the loop on each turn, busy or idle (an idle loop turns at least every
        idle_seconds / 2)."""
        now = time.monotonic()
        if busy:
            self._last_busy = now
        elif self._last_busy is not None and now - self._last_busy >= self.idle_seconds:
            self._last_busy = None
            give_back_freed_memory()


class GiveBackAfterWork:
    """For engines run in calls (offline `LLM`), which have no idle loop: when a call ends,
    gives the freed heap back once the calls since the last give-back have worked
    WORK_SECONDS_BEFORE_GIVING_BACK. Without it each call's temporaries land in different holes of the kept
    heap and the process's peak creeps up call after call (Qwen3.5 widths, 32 chats per
    call: 8.77, 8.88, 8.93, 9.01 GB over four calls; 8.85, 8.91 with a give-back between,
    what is left of the creep being KV blocks used for the first time)."""

    def __init__(self) -> None:
        self._worked = 0.0

    def call_ended(self, seconds: float) -> None:
        self._worked += seconds
        if self._worked >= WORK_SECONDS_BEFORE_GIVING_BACK:
            self._worked = 0.0
            give_back_freed_memory()


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's; musl has no malloc_trim)
    except (OSError, AttributeError):
        return None
    return libc
