"""What the engine reports about itself: the scheduler's numbers and the processor cache's."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vlmserve.core.scheduler import SchedulerStats


@dataclass
class EngineStats(SchedulerStats):
    processor_cache_hits: int = 0
    processor_cache_misses: int = 0

    @classmethod
    def of(cls, scheduler: SchedulerStats, processor_cache_hits: int, processor_cache_misses: int) -> EngineStats:
        return cls(**asdict(scheduler), processor_cache_hits=processor_cache_hits,
                   processor_cache_misses=processor_cache_misses)
