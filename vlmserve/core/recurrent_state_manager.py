"""The recurrent layers' side of the KV cache (Gated DeltaNet, Mamba-style): not blocks
but one state slot per running request, constant in size however long the sequence,
and prefix caching through snapshots of that state.

A snapshot is taken when a step ends exactly at one of the request's cache points (block
boundaries at the end of each media item, each message and the prompt: where a later
request is likely to diverge); the scheduler cuts chunks there (`chunk_end`). A hit
resumes from the longest snapshotted prefix. The slots live in a `StatePool`; copies
between slots are the runner's to make (restores before the step's forward, saves after).
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmserve.core.kv_cache_utils import BlockHash
from vlmserve.core.state_pool import StatePool
from vlmserve.request import Request


@dataclass(frozen=True)
class StateHit:
    """A snapshot of the state after the first num_tokens tokens."""

    num_tokens: int
    slot: int


class RecurrentStateManager:
    def __init__(self, pool: StatePool, block_size: int, enable_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.live: dict[str, int] = {}  # request id -> its state slot
        # request id -> this step's checkpoint slots: the state after its last token and
        # after each draft but the last (speculative decoding), given back after the step
        self.checkpoints: dict[str, list[int]] = {}

    # -- prefix cache ----------------------------------------------------------------
    def find_longest_hit(self, block_hashes: list[BlockHash], max_tokens: int) -> StateHit | None:
        """The longest snapshotted prefix of at most max_tokens tokens."""
        for n in range(max_tokens // self.block_size, 0, -1):
            slot = self.pool.lookup(block_hashes[n - 1])
            if slot is not None:
                return StateHit(n * self.block_size, slot)
        return None

    def has_snapshot(self, request: Request, num_tokens: int) -> bool:
        key = request.block_hashes[num_tokens // self.block_size - 1]
        return key in self.pool.snapshots or key in self.pool.pending

    def snapshot_pending(self, request: Request, num_tokens: int) -> bool:
        """Whether this step snapshots a state of this request's prefix past num_tokens (at
        one of its cache points, for another request that computes the same tokens now)."""
        if not self.enable_caching:
            return False
        return any(point > num_tokens and request.block_hashes[point // self.block_size - 1] in self.pool.pending
                   for point in request.cache_points
                   if point % self.block_size == 0 and point // self.block_size <= len(request.block_hashes))

    def next_cache_point(self, request: Request, start: int, end: int) -> int:
        """Where a step computing [start, end) must stop so that a snapshot can be taken
        (the state exists only at a step's end): the first cache point inside the range
        that has no snapshot yet, else end."""
        if self.enable_caching:
            for point in request.cache_points:
                if start < point < end and not self.has_snapshot(request, point):
                    return point
        return end

    def snapshot(self, request: Request, num_tokens: int) -> None:
        """Snapshots the request's state once this step has computed num_tokens tokens,
        if that is one of its cache points."""
        if self.enable_caching and num_tokens in request.cache_points and num_tokens % self.block_size == 0:
            self.pool.save(request.block_hashes[num_tokens // self.block_size - 1], self.live[request.request_id])

    # -- slots -----------------------------------------------------------------------
    def take_slot(self, request_id: str, hit: StateHit | None) -> int:
        """A live slot for a request starting (or resuming) now, restored from the hit's
        snapshot if there is one. A request that holds a slot keeps it."""
        if request_id in self.live:
            return self.live[request_id]
        slot = self.pool.take()
        if slot is None:
            raise RuntimeError("no free recurrent-state slot (more running requests than slots)")
        self.live[request_id] = slot
        if hit is not None:
            self.pool.restore(hit.slot, slot)
        return slot

    def slot(self, request_id: str) -> int | None:
        return self.live.get(request_id)

    def take_checkpoints(self, request_id: str, n: int) -> list[int] | None:
        """n checkpoint slots for a request's drafts this step; None if the pool has none."""
        slots = []
        for _ in range(n):
            slot = self.pool.take()
            if slot is None:
                for s in slots:
                    self.pool.release(s)
                return None
            slots.append(slot)
        self.checkpoints[request_id] = slots
        return slots

    def _release_checkpoints(self, request_id: str | None = None) -> None:
        """One request's checkpoint slots, or (None) every request's."""
        for rid in list(self.checkpoints) if request_id is None else [request_id]:
            for slot in self.checkpoints.pop(rid, []):
                self.pool.release(slot)

    def free(self, request_id: str) -> None:
        self._release_checkpoints(request_id)
        slot = self.live.pop(request_id, None)
        if slot is not None:
            self.pool.cancel(slot)
            self.pool.release(slot)

    def slots_in_use(self) -> int:
        return len(self.live)

    def num_snapshots(self) -> int:
        return len(self.pool.snapshots)

    # -- the step --------------------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (snapshot -> live) restores and (live -> snapshot) saves."""
        return self.pool.drain_copies()

    def commit_step(self) -> None:
        self._release_checkpoints()  # the runner has restored from them
        self.pool.commit()

    def discard_step(self) -> None:
        """After a step that failed: the snapshots it was to write hold nothing valid."""
        self._release_checkpoints()
        self.pool.abort_step()

    def reset(self) -> None:
        self.pool.reset()
