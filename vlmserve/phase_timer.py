"""Where an engine step's time goes: wall seconds per phase (scheduling, input
preparation, encoder, forward, sampling, bookkeeping, output processing), accumulated
when enabled (`EngineArgs.time_steps`, the benchmarks' --profile). Disabled, a phase
costs one attribute check."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def report(self) -> dict[str, float]:
        """Seconds per phase since the last reset."""
        return dict(self.seconds)
