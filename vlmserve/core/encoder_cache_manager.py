"""Bookkeeping of vision-encoder outputs, keyed by the media content hash.

The scheduler owns this; the runner owns the tensors and drops the entries this
manager reports as evicted. Capacity is counted in embedding tokens. An entry is
referenced by every request that still needs it (its placeholder is not yet fully in
the KV cache) and, once unreferenced, stays cached until space is needed (LRU), so a
later request with the same image skips the encoder.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vlmserve.request import Request


@dataclass
class EncoderCacheStats:
    hits: int = 0  # media items served from the cache
    misses: int = 0  # media items sent to the encoder


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.sizes: dict[str, int] = {}  # mm_hash -> embedding tokens
        self.refs: dict[str, set[str]] = {}  # mm_hash -> ids of requests that need it
        self.freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced, LRU first
        self.num_freeable_slots = 0
        self._evicted: list[str] = []
        self.stats = EncoderCacheStats()

    @property
    def num_entries(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return self.cache_size - self.num_free_slots

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """True if the item's output is cached; then the request takes a reference."""
        mm_hash = request.mm_features[input_id].mm_hash
        if mm_hash not in self.sizes:
            return False
        if request.request_id not in self.refs.get(mm_hash, ()):
            self.stats.hits += 1  # once per request, not once per step it spans
        self._add_ref(mm_hash, request.request_id)
        return True

    def can_allocate(self, request: Request, input_id: int, compute_budget: int) -> bool:
        """Whether the item fits this step's encoder budget and the cache (evicting LRU)."""
        size = request.mm_features[input_id].length
        if size > compute_budget:
            return False
        if size > self.num_free_slots + self.num_freeable_slots:
            return False
        while size > self.num_free_slots:
            victim, _ = self.freeable.popitem(last=False)
            victim_size = self.sizes.pop(victim)
            self.refs.pop(victim, None)
            self.num_freeable_slots -= victim_size
            self.num_free_slots += victim_size
            self._evicted.append(victim)
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        feature = request.mm_features[input_id]
        if feature.mm_hash not in self.sizes:
            self.sizes[feature.mm_hash] = feature.length
            self.num_free_slots -= feature.length
            self.stats.misses += 1
        self._add_ref(feature.mm_hash, request.request_id)

    def deallocate(self, request: Request, input_id: int) -> bool:
        """Undoes allocate() for an item not yet computed, whose request left this step.
        The entry stays while another request of the step still needs it (that one will
        have it encoded); returns True if the entry is gone."""
        mm_hash = request.mm_features[input_id].mm_hash
        if mm_hash not in self.sizes:
            return True
        users = self.refs.get(mm_hash, set())
        users.discard(request.request_id)
        if users:
            return False
        self._drop(mm_hash)
        self.stats.misses -= 1
        return True

    def discard(self, mm_hash: str) -> None:
        """Drops an entry whose encoder run failed (its requests have ended)."""
        if mm_hash in self.sizes:
            self._drop(mm_hash)
            self._evicted.append(mm_hash)  # the runner may hold a tensor for it

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        mm_hash = request.mm_features[input_id].mm_hash
        users = self.refs.get(mm_hash)
        if not users or request.request_id not in users:
            return
        users.discard(request.request_id)
        if not users:
            self.freeable[mm_hash] = None
            self.num_freeable_slots += self.sizes[mm_hash]

    def free(self, request: Request) -> None:
        for input_id in range(len(request.mm_features)):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """Entries evicted since the last call; the runner drops their tensors."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def reset(self) -> None:
        """Drops every entry (the engine must be idle); they are reported as evicted, so
        the runner drops their tensors. The hit and miss counters keep counting."""
        assert self.num_referenced() == 0, "cannot reset the encoder cache while requests use it"
        for mm_hash in list(self.sizes):
            self._drop(mm_hash)
            self._evicted.append(mm_hash)

    def num_referenced(self) -> int:
        return sum(1 for users in self.refs.values() if users)

    def _drop(self, mm_hash: str) -> None:
        size = self.sizes.pop(mm_hash)
        self.refs.pop(mm_hash, None)
        if mm_hash in self.freeable:
            del self.freeable[mm_hash]
            self.num_freeable_slots -= size
        self.num_free_slots += size

    def _add_ref(self, mm_hash: str, request_id: str) -> None:
        users = self.refs.setdefault(mm_hash, set())
        if not users and mm_hash in self.freeable:
            del self.freeable[mm_hash]
            self.num_freeable_slots -= self.sizes[mm_hash]
        users.add(request_id)
