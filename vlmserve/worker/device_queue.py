"""Where a step's device work runs: in submission order, apart from the host's
bookkeeping, so that the host can prepare the next step while the device computes this one.

On a GPU that is what launching kernels does already: the work is queued on the stream by
the call itself, so the queue runs it where it is called and the host goes on (its results
come back by a copy the host awaits later). On the CPU the same overlap needs a thread of its
own — the forward thread — which runs each piece of work in turn while the engine's thread
schedules, prepares and processes outputs. That thread also builds the model, so that it is
the one thread of the process that runs parallel torch ops (a second OpenMP team on the same
cores makes every kernel call wait for a wake-up: engine/processing_pool.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class DeviceQueue:
    """threaded: a forward thread of its own (async scheduling on the CPU); else the work
    runs where it is submitted."""

    def __init__(self, threaded: bool = False) -> None:
        self.threaded = threaded
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="vlmserve-forward", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """fn's result, as a future: done at once unless threaded."""
        future: Future[T] = Future()
        if not self.threaded:
            run_into(future, fn)
        else:
            self._work.put((future, fn))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Runs fn in order after the work submitted so far, and waits for it."""
        return self.submit(fn).result()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            run_into(*item)


def run_into(future: Future, fn: Callable[[], Any]) -> None:
    """fn's result (or its error) into future."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as e:  # handed to whoever waits for it
        future.set_exception(e)
