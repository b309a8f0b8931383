"""A host-memory tier under the device's prefix cache (vLLM's --kv-offloading-size).

A block the device cache evicts is copied to a host slot under its hash; a later request
whose prefix it holds gets it copied back into a new device block instead of computing
it again. The hashes are the prefix cache's (pictures, adapter and cache salt included), so
a slot is only ever read for the same tokens and pictures.

Bookkeeping only (a KVConnector, core/kv_connector.py): the runner moves the bytes
(worker/kv_connector_worker.py) before each step's forward.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from vlmserve.core.block_pool import BlockHashWithGroup
from vlmserve.core.kv_connector import KVConnector, KVTransfers


class HostKVTier(KVConnector):
    def __init__(self, num_slots: int) -> None:
        super().__init__()
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: OrderedDict[BlockHashWithGroup, int] = OrderedDict()  # least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.reading: set[int] = set()  # slots its loads read: none of its saves may take them
        self.saved_now: list[BlockHashWithGroup] = []
        # the keys saved by each step scheduled but not ended: a failed step's computed
        # blocks may have been evicted (and saved) before its failure was known
        self.unconfirmed: deque[list[BlockHashWithGroup]] = deque()

    def find(self, keys: list[BlockHashWithGroup]) -> int:
        """How many of keys, from the first, the tier holds (nothing is touched)."""
        n = 0
        while n < len(keys) and keys[n] in self.slot_of:
            n += 1
        return n

    def reserve(self, keys: list[BlockHashWithGroup]) -> list[int]:
        """The slots of keys (all held: find() said so this step), kept from this step's
        saves: the device blocks they go to are allocated next, and may evict others."""
        slots = []
        for key in keys:
            self.slot_of.move_to_end(key)
            slots.append(self.slot_of[key])
        self.reading.update(slots)
        return slots

    def evicted(self, device_block: int, key: BlockHashWithGroup) -> None:
        """Keeps an evicted device block: copied to the least recently used slot, unless the
        tier holds it already."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:  # every slot is read by this step's loads
            return
        self.slot_of[key] = slot
        self.step.saves.append((device_block, slot))
        self.saved_now.append(key)
        self.stats.blocks_saved += 1

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.slot_of.items():
            if slot not in self.reading:
                del self.slot_of[key]
                return slot
        return None

    def take_transfers(self) -> KVTransfers:
        self.reading.clear()
        self.unconfirmed.append(self.saved_now)
        self.saved_now = []
        return super().take_transfers()

    def commit_step(self) -> None:
        """What the oldest step in flight saved holds what it should."""
        if self.unconfirmed:
            self.unconfirmed.popleft()

    def discard_unconfirmed(self) -> None:
        for keys in self.unconfirmed:
            for key in keys:
                slot = self.slot_of.pop(key, None)
                if slot is not None:
                    self.free_slots.append(slot)
        self.unconfirmed.clear()

    def reset(self) -> None:
        self.slot_of.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.unconfirmed.clear()
        self.saved_now = []

    @property
    def num_held(self) -> int:
        return len(self.slot_of)
