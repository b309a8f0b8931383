"""The scheduler's interface to KV memory: prefix hits, slot allocation, freeing."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmserve.core.block_pool import BlockPool, KVCacheBlock
from vlmserve.core.kv_cache_spec import KVCacheConfig, MambaSpec
from vlmserve.core.single_type_kv_cache_manager import MambaManager, make_manager
from vlmserve.core.state_pool import StatePool
from vlmserve.request import Request

# per KV cache group, a request's blocks
KVCacheBlocks = tuple[list[KVCacheBlock], ...]


@dataclass
class PrefixCacheStats:
    """Counted in tokens, per KV cache group (lookups are only made for new requests)."""

    queries: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, max_model_len: int, enable_caching: bool = True) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(config.num_blocks, enable_caching)
        self.state_pool = StatePool(config.num_state_slots)
        self.managers = [
            MambaManager(g.spec, self.state_pool, i, enable_caching)
            if isinstance(g.spec, MambaSpec)
            else make_manager(g.spec, self.block_pool, i)
            for i, g in enumerate(config.groups)
        ]
        self.has_recurrent_groups = any(isinstance(m, MambaManager) for m in self.managers)
        block_sizes = {g.spec.block_size for g in config.groups}
        if len(block_sizes) != 1:
            raise ValueError(f"all KV cache groups must share one block size, got {block_sizes}")
        self.block_size = block_sizes.pop()
        self.stats = PrefixCacheStats([0] * len(self.managers), [0] * len(self.managers))
        self._last_lookup: tuple[str, list[int]] = ("", [])

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def empty_blocks(self) -> KVCacheBlocks:
        return tuple([] for _ in self.managers)

    # -- prefix cache ---------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix usable by every group, and its length in tokens.

        The last prompt token is always recomputed: its logits give the first output.
        Requests asking for prompt logprobs need every position computed, so they skip
        the lookup.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_blocks(), 0
        max_length = min(request.num_tokens - 1, len(request.block_hashes) * self.block_size)
        length = max_length
        first_pass: list[int] | None = None
        while True:
            hits = [m.find_longest_cache_hit(request.block_hashes, length) for m in self.managers]
            lengths = [len(h) * self.block_size for h in hits]
            if first_pass is None:
                first_pass = lengths
            shortest = min(lengths, default=0)
            if shortest == length:
                break
            # a shorter hit in one group bounds all of them; ask every group again, since a
            # sliding-window hit is not simply a prefix of a longer one
            length = shortest
        self._last_lookup = (request.request_id, first_pass)
        return tuple(hits), length

    def record_lookup(self, request: Request) -> None:
        """Counts the last lookup of this request in the prefix-cache stats (once it is
        scheduled, so a request that waits several steps is counted once)."""
        rid, group_hits = self._last_lookup
        if rid != request.request_id:
            group_hits = [0] * self.num_groups
        for g, hit in enumerate(group_hits):
            self.stats.queries[g] += request.num_tokens
            self.stats.hits[g] += hit

    # -- allocation -------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Makes room for num_new_tokens more tokens; None if the pool cannot.

        Prefix hits (new_computed_blocks, num_new_computed_tokens tokens) are taken
        first. On success, the request's full blocks are registered in the prefix cache.
        """
        if new_computed_blocks is None:
            new_computed_blocks = self.empty_blocks()
        rid = request.request_id
        for manager in self.managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        needed = sum(
            m.get_num_blocks_to_allocate(rid, num_tokens, new_computed_blocks[g])
            for g, m in enumerate(self.managers)
        )
        if needed > self.block_pool.get_num_free_blocks():
            return None

        new_blocks = []
        for g, manager in enumerate(self.managers):
            manager.save_new_computed_blocks(rid, new_computed_blocks[g])
            new_blocks.append(manager.allocate_new_blocks(rid, num_tokens))
        if self.enable_caching:
            cacheable = min(num_tokens, request.num_tokens)
            for manager in self.managers:
                manager.cache_blocks(request, cacheable)
        return tuple(new_blocks)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.state_pool.reset()
        return True

    # -- recurrent groups ------------------------------------------------------------------
    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """Where a step computing [start, end) must stop so that a recurrent group can
        snapshot its state at a cache point (the state exists only at a step's end)."""
        if not (self.enable_caching and self.has_recurrent_groups):
            return end
        mamba = next(m for m in self.managers if isinstance(m, MambaManager))
        for point in request.cache_points:
            if start < point < end and not mamba.has_snapshot(request, point):
                return point
        return end

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (snapshot -> live) restores and (live -> snapshot) saves."""
        return self.state_pool.drain_copies()

    def commit_step(self) -> None:
        self.state_pool.commit()

    def discard_step(self, computed_before: dict[str, int]) -> None:
        """After a step that failed: what it was to compute must not be hit later.
        computed_before: request id -> tokens it had computed before the step."""
        for request_id, num_tokens in computed_before.items():
            for manager in self.managers:
                manager.forget_from(request_id, num_tokens)
        self.state_pool.abort_step()

    # -- views ---------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Per group: block ids (attention) or the live state slot (recurrent)."""
        return tuple(m.block_ids(request_id) for m in self.managers)

    def num_held_blocks(self, request_id: str) -> list[int]:
        return [m.num_held_blocks(request_id) for m in self.managers]

    def blocks_in_use(self) -> list[int]:
        """Per group: KV blocks referenced by some request, or live state slots."""
        return [m.blocks_in_use() for m in self.managers]

    def group_kinds(self) -> list[str]:
        return [type(g.spec).__name__ for g in self.config.groups]

    def state_slots_in_use(self) -> int:
        """Live recurrent-state slots (one per running request of a hybrid model)."""
        return sum(len(m.live) for m in self.managers if isinstance(m, MambaManager))

    def num_state_snapshots(self) -> int:
        return len(self.state_pool.snapshots)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def max_blocks_for_request(self, num_tokens: int) -> int:
        """Blocks one request of num_tokens needs at its peak, summed over groups."""
        return sum(m.spec.max_blocks_for(num_tokens) for m in self.managers)
