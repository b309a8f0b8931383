"""Where KV blocks go beyond the device cache, and come back from (the seeds' KV connector,
one step at a time): the scheduler's side of it. No tensors here.

A connector answers how far a new request's prefix hit goes on past the device's blocks
(`find`), takes the blocks it supplies (`reserve`, then `load` into new device blocks), and
is told of blocks the device cache evicts (`evicted`) and of blocks a step computes
(`computed`), keeping what it wants of them. Each step's copies go to the runner in the
SchedulerOutput's `KVTransfers`; the runner's side (worker/kv_connector_worker.py) makes
them: `saves` and `loads` before the step's forward (saves first: an evicted block may be a
load's target in the same step), `saves_after` after it (blocks the forward fills).

The keys are the prefix cache's (block hash, group): the hashes take in each picture's
content hash, the LoRA adapter and the cache salt, so a stored block is only ever read for
the same tokens and pictures.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from vlmserve.core.block_pool import BlockHashWithGroup


@dataclass
class KVTransfers:
    """One step's copies between device blocks and a connector's store. Where a block goes
    or comes from is the connector's own address (a host slot; a key with the bytes)."""

    saves: list[tuple[int, Any]] = field(default_factory=list)  # (device block, to): before the forward
    loads: list[tuple[Any, int]] = field(default_factory=list)  # (from, device block): before the forward
    saves_after: list[tuple[int, Any]] = field(default_factory=list)  # (device block, to): after the forward

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.saves_after)


@dataclass
class ConnectorStats:
    """Cumulative. Queries and hits in prompt tokens (vLLM's external prefix cache)."""

    queries: int = 0
    hits: int = 0
    blocks_saved: int = 0
    blocks_loaded: int = 0
    fetch_seconds: float = 0.0  # a pool's lookups and fetches while scheduling


class KVConnector(ABC):
    def __init__(self) -> None:
        self.stats = ConnectorStats()
        self.step = KVTransfers()  # the copies of the step being scheduled

    @abstractmethod
    def find(self, keys: list[BlockHashWithGroup]) -> int:
        """How many of keys, from the first, the store can supply now."""

    @abstractmethod
    def reserve(self, keys: list[BlockHashWithGroup]) -> list[Any]:
        """Where each of keys (all found this step) comes from, kept until the step's
        copies are taken: the device blocks they go to are allocated next, and may evict others."""

    def load(self, sources: list[Any], device_blocks: list[int]) -> None:
        """Copies reserved blocks into new device blocks, before the step's forward."""
        self.step.loads.extend(zip(sources, device_blocks, strict=True))
        self.stats.blocks_loaded += len(sources)

    def encoder_output(self, mm_hash: str) -> bytes | None:
        """A medium's encoder output another engine stored (serialized; None: not there)."""
        return None

    def evicted(self, device_block: int, key: BlockHashWithGroup) -> None:
        """The device cache gives a cached block to new content (its bytes are still there)."""

    def computed(self, device_blocks: list[int], keys: list[BlockHashWithGroup]) -> None:
        """Blocks this step fills (registered in the prefix cache as they are allocated)."""

    def take_transfers(self) -> KVTransfers:
        """The copies of the step just scheduled; the next step's start empty."""
        transfers, self.step = self.step, KVTransfers()
        return transfers

    def commit_step(self) -> None:
        """The oldest step in flight ended."""

    def discard_unconfirmed(self) -> None:
        """A step failed: forget what the steps in flight were to store."""

    def reset(self) -> None:
        """Forget everything kept (the prefix cache was reset)."""

    @property
    def num_held(self) -> int:
        """Blocks held where that is known (a shared pool's: 0)."""
        return 0

    def shutdown(self) -> None:
        pass
