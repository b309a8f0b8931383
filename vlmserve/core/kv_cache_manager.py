"""The scheduler's interface to KV memory: prefix hits, slot allocation, freeing.

Attention groups hold blocks (one manager per group, sharing one block pool); recurrent
groups hold a state slot per request (`RecurrentStateManager`). A prefix hit needs both:
the attention blocks of the prefix, and a snapshot of the recurrent state at its end.
With a KV connector (a host tier, a shared pool; full-attention models), a hit goes on
past the device's blocks with the connector's, copied into new blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmserve.core.block_pool import BlockPool, KVCacheBlock
from vlmserve.core.host_kv_tier import HostKVTier
from vlmserve.core.kv_connector import KVConnector, KVTransfers
from vlmserve.core.kv_cache_spec import AttentionSpec, FullAttentionSpec, KVCacheConfig
from vlmserve.core.mooncake_pool import MooncakeConnector
from vlmserve.core.recurrent_state_manager import RecurrentStateManager, StateHit
from vlmserve.core.single_type_kv_cache_manager import make_manager
from vlmserve.core.state_pool import StatePool
from vlmserve.request import Request


@dataclass
class PrefixCacheStats:
    """Counted in tokens, per KV cache group (lookups are only made for new requests)."""

    queries: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class QuietUntil:
    """Until when a request's allocations have nothing to do (most of a decode's steps):
    while its slots fit the blocks it holds, no block of it fills up for the prefix cache,
    and no block falls out of a sliding window."""

    slots: int  # the slots its blocks hold
    cache_at: int  # the tokens at which its next block is full (registered in the prefix cache)
    skip_at: int  # the computed tokens at which a sliding window lets go of a block


@dataclass
class PrefixHit:
    """The longest cached prefix of a request that every group can serve."""

    num_tokens: int
    blocks: list[list[KVCacheBlock]]  # per attention group
    state: StateHit | None  # the recurrent state's snapshot at num_tokens
    group_tokens: list[int]  # what each group (in config order) found alone, for the stats
    connector_blocks: int = 0  # blocks past the device's that the KV connector supplies (in num_tokens)


def make_connector(config: KVCacheConfig) -> KVConnector | None:
    """The scheduler's side of the KV connector the config names, if any."""
    if config.pool is not None:
        return MooncakeConnector(config.pool, block_bytes(config))
    return HostKVTier(config.num_host_blocks) if config.num_host_blocks else None


def block_bytes(config: KVCacheConfig) -> int:
    """A block id's bytes across every attention layer (its tensor slots)."""
    pages = [g.spec.page_size_bytes for g in config.groups if isinstance(g.spec, AttentionSpec)]
    return max(pages, default=0) * config.num_tensor_slots


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, max_model_len: int, enable_caching: bool = True) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.connector = connector = make_connector(config)
        if connector and not (enable_caching and all(isinstance(g.spec, FullAttentionSpec) for g in config.groups)):
            raise ValueError("a KV connector needs prefix caching and only full-attention layers")
        self.block_pool = BlockPool(config.num_blocks, enable_caching, connector.evicted if connector else None)
        block_sizes = {g.spec.block_size for g in config.groups}
        if len(block_sizes) != 1:
            raise ValueError(f"all KV cache groups must share one block size, got {block_sizes}")
        self.block_size = block_sizes.pop()
        # (index in config.groups, manager) of each attention group
        self.attention_managers = [(i, make_manager(g.spec, self.block_pool, i))
                                   for i, g in enumerate(config.groups) if isinstance(g.spec, AttentionSpec)]
        self.recurrent_groups = [i for i, g in enumerate(config.groups) if not isinstance(g.spec, AttentionSpec)]
        pool = StatePool(config.num_state_slots, config.num_state_snapshots)
        self.states = RecurrentStateManager(pool, self.block_size, enable_caching) if self.recurrent_groups else None
        self.stats = PrefixCacheStats([0] * len(config.groups), [0] * len(config.groups))
        self.quiet: dict[str, QuietUntil] = {}

    # -- prefix cache ---------------------------------------------------------------
    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """The longest cached prefix usable by every group.

        The last prompt token is always recomputed: its logits give the first output.
        Requests that need every position computed (prompt logprobs; an embedding that
        pools over all of them) skip the lookup.
        """
        no_hit = PrefixHit(0, [[] for _ in self.attention_managers], None, [0] * len(self.config.groups))
        if not self.enable_caching or request.computes_every_prompt_token:
            return no_hit
        length = min(request.num_tokens - 1, len(request.block_hashes) * self.block_size)
        group_tokens: list[int] | None = None
        while True:
            blocks = [m.find_longest_cache_hit(request.block_hashes, length) for _, m in self.attention_managers]
            lengths = [len(b) * self.block_size for b in blocks]
            state = self.states.find_longest_hit(request.block_hashes, min(lengths, default=length)) \
                if self.states else None
            if self.states:
                lengths.append(state.num_tokens if state else 0)
            if group_tokens is None:
                group_tokens = self._by_group(lengths)
            shortest = min(lengths, default=0)
            if shortest == length:
                return self._with_connector_blocks(request, PrefixHit(length, blocks, state, group_tokens))
            # a shorter hit in one group bounds all of them; ask every group again, since a
            # sliding-window hit is not simply a prefix of a longer one
            length = shortest

    def _with_connector_blocks(self, request: Request, hit: PrefixHit) -> PrefixHit:
        """The hit, grown by the blocks after it that the KV connector supplies for every
        group (short of the last prompt token)."""
        if self.connector is None:
            return hit
        first, last = hit.num_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[first:last]
        n = min(self.connector.find([(h, g) for h in hashes]) if hashes else 0 for g, _ in self.attention_managers)
        if n:
            hit.num_tokens += n * self.block_size
            hit.connector_blocks = n
        return hit

    def longer_hit_next_step(self, request: Request, hit: PrefixHit) -> bool:
        """Whether the request's prefix hit grows once this step ends: a recurrent state
        of a longer prefix is snapshotted by it (attention blocks are shared within the
        step, a recurrent state only after it)."""
        if self.states is None or request.computes_every_prompt_token:  # it takes no hit: waiting gains nothing
            return False
        return self.states.snapshot_pending(request, hit.num_tokens)

    def _by_group(self, lengths: list[int]) -> list[int]:
        """Hit lengths listed attention groups first, recurrent last -> config order."""
        out = [0] * len(self.config.groups)
        for (g, _), n in zip(self.attention_managers, lengths):
            out[g] = n
        for g in self.recurrent_groups:
            out[g] = lengths[-1]
        return out

    def record_hit(self, request: Request, hit: PrefixHit) -> None:
        """Counts a request's lookup in the stats (once it is scheduled, so a request that
        waits several steps is counted once)."""
        for g, tokens in enumerate(hit.group_tokens):
            self.stats.queries[g] += request.num_tokens
            self.stats.hits[g] += tokens
        if self.connector:
            self.connector.stats.queries += request.num_tokens
            self.connector.stats.hits += hit.connector_blocks * self.block_size

    # -- allocation -------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                       num_lookahead_tokens: int = 0) -> list[list[int]] | None:
        """Makes room for num_new_tokens more tokens, and num_lookahead_tokens after them
        (a draft model's guesses); None if the pool cannot. Returns the new block ids per
        attention group.

        A new request's prefix hit is taken first (its blocks, its state snapshot). On
        success, the request's full blocks are registered in the prefix cache.
        """
        rid = request.request_id
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        num_slots = min(num_tokens + num_lookahead_tokens, self.max_model_len)
        quiet = self.quiet.get(rid)
        if quiet is not None and hit is None and num_slots <= quiet.slots and num_computed < quiet.skip_at \
                and (not self.enable_caching or min(num_tokens, request.num_tokens) < quiet.cache_at):
            return [[] for _ in self.attention_managers]  # nothing to do: the common decode step
        for _, manager in self.attention_managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)
        hit_blocks = hit.blocks if hit else [[] for _ in self.attention_managers]
        needed = sum(m.get_num_blocks_to_allocate(rid, num_slots, hit_blocks[a])
                     for a, (_, m) in enumerate(self.attention_managers))
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if self.states:
            self.states.take_slot(rid, hit.state if hit else None)
        sources = self._reserve_connector_blocks(request, hit)
        # every group's hits leave the free queue before any group takes new blocks from
        # it: a hit of one group must not be handed to another as a new block
        for a, (_, manager) in enumerate(self.attention_managers):
            manager.save_new_computed_blocks(rid, hit_blocks[a])
        new_blocks = [[b.block_id for b in manager.allocate_new_blocks(rid, num_slots)]
                      for _, manager in self.attention_managers]
        for group_sources, blocks in zip(sources, new_blocks):  # the first new blocks take the connector's
            self.connector.load(group_sources, blocks[:len(group_sources)])
        cacheable = min(num_tokens, request.num_tokens)
        if self.enable_caching:
            for g, manager in self.attention_managers:
                filled = manager.cache_blocks(request, cacheable)
                if self.connector and filled:
                    self.connector.computed([b.block_id for b, _ in filled], [(h, g) for _, h in filled])
            if self.states:
                self.states.snapshot(request, cacheable)
        self._note_quiet(request, num_computed, cacheable)
        return new_blocks

    def _reserve_connector_blocks(self, request: Request, hit: PrefixHit | None) -> list[list]:
        """Per attention group, where the hit's connector blocks come from (none: [])."""
        if hit is None or not hit.connector_blocks:
            return []
        first = hit.num_tokens // self.block_size - hit.connector_blocks
        hashes = request.block_hashes[first:first + hit.connector_blocks]
        return [self.connector.reserve([(h, g) for h in hashes]) for g, _ in self.attention_managers]

    def _note_quiet(self, request: Request, num_computed: int, cacheable: int) -> None:
        """Until when the request's next allocations have nothing to do (QuietUntil); none
        while a recurrent-state snapshot may still be due (a cache point ahead)."""
        rid = request.request_id
        if self.states and request.cache_points and request.cache_points[-1] > cacheable:
            self.quiet.pop(rid, None)
            return
        managers = [m for _, m in self.attention_managers]
        self.quiet[rid] = QuietUntil(
            slots=min((m.num_slots(rid) for m in managers), default=self.max_model_len),
            cache_at=min((m.next_full_block_at(rid) for m in managers), default=self.max_model_len + 1),
            skip_at=min((m.next_skip_at(rid, num_computed) for m in managers), default=self.max_model_len + 1))

    def take_draft_checkpoints(self, request: Request, num_drafts: int) -> list[int] | None:
        """Recurrent-state slots for the state after each draft position this step but
        the last (so a partial acceptance resumes from the last kept token): [] for models
        without recurrent layers, None if the pool has no free slots."""
        return self.states.take_checkpoints(request.request_id, num_drafts) if self.states else []

    def draft_checkpoints(self) -> dict[str, list[int]]:
        """This step's checkpoint slots, by request."""
        return dict(self.states.checkpoints) if self.states else {}

    def free(self, request: Request) -> None:
        self.quiet.pop(request.request_id, None)
        for _, manager in self.attention_managers:
            manager.free(request.request_id)
        if self.states:
            self.states.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.states:
            self.states.reset()
        if self.connector:
            self.connector.reset()
        return True

    # -- the step ------------------------------------------------------------------------
    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """Where a step computing [start, end) must stop so that the recurrent state can
        be snapshotted at a cache point."""
        return self.states.next_cache_point(request, start, end) if self.states else end

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (snapshot -> live) restores and (live -> snapshot) saves."""
        return self.states.take_copies() if self.states else ([], [])

    def shared_encoder_output(self, mm_hash: str) -> bytes | None:
        """A medium's encoder output from the KV connector's store (serialized), if it has one."""
        return self.connector.encoder_output(mm_hash) if self.connector else None

    def take_kv_transfers(self) -> KVTransfers:
        """The step's copies between device blocks and the KV connector."""
        return self.connector.take_transfers() if self.connector else KVTransfers()

    def commit_step(self) -> None:
        if self.states:
            self.states.commit_step()
        if self.connector:
            self.connector.commit_step()

    def discard_step(self, computed_before: dict[str, int]) -> None:
        """After a step that failed: what it was to compute must not be hit later.
        computed_before: request id -> tokens it had computed before the step."""
        for request_id, num_tokens in computed_before.items():
            self.quiet.pop(request_id, None)
            for _, manager in self.attention_managers:
                manager.forget_from(request_id, num_tokens)
        if self.states:
            self.states.discard_step()
        if self.connector:
            self.connector.discard_unconfirmed()

    def forget_uncomputed(self, request: Request) -> None:
        """Unregisters the request's blocks past what it has computed: taken out of the
        step that was to fill them, they hold no valid keys."""
        self.quiet.pop(request.request_id, None)
        for _, manager in self.attention_managers:
            manager.forget_from(request.request_id, request.num_computed_tokens)

    # -- views ---------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[list[int]]:
        """Per attention group: the request's block ids."""
        return [m.block_ids(request_id) for _, m in self.attention_managers]

    def state_slot(self, request_id: str) -> int | None:
        """The request's recurrent-state slot (None without recurrent layers)."""
        return self.states.slot(request_id) if self.states else None

    def num_held_blocks(self, request_id: str) -> list[int]:
        return [m.num_held_blocks(request_id) for _, m in self.attention_managers]

    def group_kinds(self) -> list[str]:
        return [type(g.spec).__name__ for g in self.config.groups]

    def blocks_in_use(self) -> dict[int, int]:
        """Per attention group (by its index in the config): KV blocks some request holds."""
        return {g: m.blocks_in_use() for g, m in self.attention_managers}

    def state_slots_in_use(self) -> int:
        return self.states.slots_in_use() if self.states else 0

    def num_state_snapshots(self) -> int:
        return self.states.num_snapshots() if self.states else 0

    def connector_stats(self) -> dict[str, float]:
        """The KV connector's numbers, as SchedulerStats names them (none without one)."""
        if self.connector is None:
            return {}
        stats = self.connector.stats
        return dict(connector_queries=stats.queries, connector_hits=stats.hits,
                    connector_blocks_saved=stats.blocks_saved, connector_blocks_loaded=stats.blocks_loaded,
                    connector_blocks_held=self.connector.num_held, connector_block_bytes=block_bytes(self.config),
                    connector_load_seconds=stats.fetch_seconds)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
