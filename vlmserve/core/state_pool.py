"""Slots for the recurrent state of hybrid models: live ones, one per running request,
and prefix-cache snapshots, keyed by the block hash of the prefix they end.

A snapshot costs a whole state (heads x d_k x d_v per layer), so only a bounded number
are kept, evicted LRU. Copies between slots are data movement, which belongs to the
runner: the pool records them, the scheduler hands them over in SchedulerOutput.
"""

from __future__ import annotations

from collections import OrderedDict

from vlmserve.core.kv_cache_utils import BlockHash


class StatePool:
    """num_slots slots, of which snapshots hold at most max_snapshots at once (committed and
    pending together): the others stay for running requests (and their draft
    checkpoints), which the scheduler admits counting on a slot each."""

    def __init__(self, num_slots: int, max_snapshots: int) -> None:
        self.num_slots, self.max_snapshots = num_slots, max_snapshots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.snapshots: OrderedDict[BlockHash, int] = OrderedDict()  # committed, LRU first
        self.pending: dict[BlockHash, int] = {}  # written at the end of this step
        self.pinned: set[int] = set()  # read or written by this step's copies
        self.restores: list[tuple[int, int]] = []  # (snapshot, live) before the forward
        self.saves: list[tuple[int, int]] = []  # (live, snapshot) after the forward

    def take(self) -> int | None:
        """A free slot, evicting the least recently used snapshot if need be."""
        return self.free.pop() if self.free else self._evict_lru()

    def _evict_lru(self) -> int | None:
        for key, slot in self.snapshots.items():
            if slot not in self.pinned:
                del self.snapshots[key]
                return slot
        return None

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def lookup(self, key: BlockHash) -> int | None:
        slot = self.snapshots.get(key)
        if slot is not None:
            self.snapshots.move_to_end(key)
        return slot

    def restore(self, snapshot: int, live: int) -> None:
        self.pinned.add(snapshot)
        self.restores.append((snapshot, live))

    def save(self, key: BlockHash, live: int) -> None:
        """Snapshots a live state under key once this step has computed it."""
        if key in self.snapshots or key in self.pending:
            return
        # at the allowance a new snapshot replaces the oldest: a free slot taken past it
        # could be the one a request admitted later in this step needs
        under = len(self.snapshots) + len(self.pending) < self.max_snapshots
        slot = self.take() if under else self._evict_lru()
        if slot is None:
            return  # every slot is busy: skip this snapshot
        self.pinned.add(slot)
        self.pending[key] = slot
        self.saves.append((live, slot))

    def cancel(self, live: int) -> None:
        """Drops this step's copies into or out of a live slot given up mid-schedule."""
        self.restores = [(s, d) for s, d in self.restores if d != live]
        dropped = [d for s, d in self.saves if s == live]
        self.saves = [(s, d) for s, d in self.saves if s != live]
        for key in [k for k, slot in self.pending.items() if slot in dropped]:
            slot = self.pending.pop(key)
            self.pinned.discard(slot)
            self.free.append(slot)

    def drain_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        restores, saves = self.restores, self.saves
        self.restores, self.saves = [], []
        return restores, saves

    def commit(self) -> None:
        """After the step: the snapshots it wrote can now be hit."""
        self.snapshots.update(self.pending)
        self.pending.clear()
        self.pinned.clear()

    def abort_step(self) -> None:
        """After a step that failed: the snapshots it was to write hold nothing valid."""
        self.free.extend(self.pending.values())
        self.pending.clear()
        self.pinned.clear()
        self.restores, self.saves = [], []

    def reset(self) -> None:
        """Forgets every snapshot (live slots are untouched)."""
        for slot in self.snapshots.values():
            self.free.append(slot)
        self.snapshots.clear()
