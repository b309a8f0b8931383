"""Block bookkeeping of one attention group of the KV cache, by the kind of attention its
layers do (full, sliding window). Recurrent groups hold states, not blocks: see
recurrent_state_manager.py."""

from __future__ import annotations

from collections import defaultdict

from vlmserve.core.block_pool import BlockPool, KVCacheBlock
from vlmserve.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vlmserve.core.kv_cache_utils import BlockHash
from vlmserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        # a request's blocks, position by position (null blocks where let go)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # how many of a request's leading blocks are registered in the prefix cache
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks[request_id]) + len(new_computed_blocks)
        # cache hits sitting in the free queue are taken out of it, like new blocks
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_required - held, 0) + revived

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "only a new request can take prefix-cache hits"
            return
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id].extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> list[tuple[KVCacheBlock, BlockHash]]:
        """Registers the request's blocks full at num_tokens; returns the ones new to it."""
        num_cached = self.num_cached_block[request.request_id]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return []
        blocks = self.req_to_blocks[request.request_id][num_cached:num_full]
        hashes = request.block_hashes[num_cached:num_full]
        self.block_pool.cache_full_blocks(blocks, hashes, self.group_id)
        self.num_cached_block[request.request_id] = num_full
        return list(zip(blocks, hashes))

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Lets go of blocks no future query of the request can see."""

    def forget_from(self, request_id: str, num_tokens: int) -> None:
        """Unregisters the request's blocks from token num_tokens on, which a failed step
        was to fill: they were hashed when allocated, but hold no valid keys."""
        for block in self.req_to_blocks.get(request_id, [])[num_tokens // self.block_size:]:
            self.block_pool.uncache(block)

    def num_slots(self, request_id: str) -> int:
        """The token slots the request's blocks hold (let-go blocks included)."""
        return len(self.req_to_blocks[request_id]) * self.block_size

    def next_full_block_at(self, request_id: str) -> int:
        """The tokens at which the request's next block is full and registered."""
        return (self.num_cached_block.get(request_id, 0) + 1) * self.block_size

    def next_skip_at(self, request_id: str, num_computed_tokens: int) -> float:
        """The computed tokens at which a block of the request is let go (never: inf)."""
        return float("inf")

    def num_held_blocks(self, request_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(request_id, []) if not b.is_null)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def blocks_in_use(self) -> int:
        return len({b.block_id for blocks in self.req_to_blocks.values() for b in blocks if not b.is_null})

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        hit: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hit.append(block)
        return hit


class SlidingWindowManager(SingleTypeKVCacheManager):
    spec: SlidingWindowSpec

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Longest prefix whose last window is cached; blocks before it may be gone.

        Scans from the right for enough contiguous cached blocks to cover the window that
        the first uncached token looks back on; earlier positions get the null block.
        """
        window_blocks = cdiv(self.spec.sliding_window - 1, self.block_size)
        num_blocks = max_length // self.block_size
        hit = [self.block_pool.null_block] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run >= window_blocks:
                return hit[: i + run]
        # no full window anywhere: only a run starting at block 0 is usable
        return hit[:run]

    def next_skip_at(self, request_id: str, num_computed_tokens: int) -> float:
        skipped = max(num_computed_tokens - self.spec.sliding_window + 1, 0) // self.block_size
        return (skipped + 1) * self.block_size + self.spec.sliding_window - 1

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        first_visible_token = num_computed_tokens - self.spec.sliding_window + 1
        num_skipped = max(first_visible_token, 0) // self.block_size
        blocks = self.req_to_blocks[request_id]
        null = self.block_pool.null_block
        released = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was let go earlier
            released.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(released)


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, group_id)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_pool, group_id)
    raise TypeError(f"no KV cache manager for {type(spec).__name__}")
