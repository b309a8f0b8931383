"""What the replica router decided, counted in the ingress process for its /metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class RoutingStats:
    """What the router decided, for /metrics (one per ingress process)."""

    decisions: dict[str, int] = field(default_factory=dict)  # affinity | least_loaded | imbalanced
    picture_keys: int = 0  # pictures in routed requests
    picture_hits: int = 0  # ... that went to a replica which had seen them
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, decision: str, pictures: int, hits: int) -> None:
        with self.lock:
            self.decisions[decision] = self.decisions.get(decision, 0) + 1
            self.picture_keys += pictures
            self.picture_hits += hits


ROUTING = RoutingStats()
