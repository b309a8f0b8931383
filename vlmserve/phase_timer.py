"""Where an engine step's time goes: wall seconds per phase, accumulated when enabled
(`EngineArgs.time_steps`, the benchmarks' --profile). Disabled, a phase costs one
attribute check.

The host's phases (scheduling, grammar masks, input preparation, launching, output
handling, the scheduler's update, output processing and detokenizing) and the time it
waits for the device are timed where they run; the device work's phases (encoder,
forward, sampling: `DEVICE_PREFIX`) are timed on the thread that runs them and merged in
when the host takes the step's output. `host_seconds()` is the host's share of a step:
everything but the device's phases, the wait for them and the whole step's own time."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from collections.abc import Iterator
from contextlib import contextmanager


DEVICE_PREFIX = "device: "
WAIT = "runner: wait for the device"
STEP = "step (all)"


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

    def merge(self, seconds: Mapping[str, float]) -> None:
        """Adds phases timed elsewhere (the device work's, on its own thread)."""
        for name, value in seconds.items():
            self.seconds[name] += value

    def host_seconds(self) -> float:
        """The host's work since the last reset (see the module's docstring)."""
        return sum(v for k, v in self.seconds.items() if not k.startswith(DEVICE_PREFIX) and k not in (WAIT, STEP))

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def report(self) -> dict[str, float]:
        """Seconds per phase since the last reset."""
        return dict(self.seconds)
