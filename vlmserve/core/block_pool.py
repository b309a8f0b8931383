"""Physical KV blocks: the free queue (LRU), ref counts and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vlmserve.core.kv_cache_utils import BlockHash

# A cached block is found by its hash *and* its KV cache group: groups keep different
# tensors, so the same token prefix is a different block in each of them.
BlockHashWithGroup = tuple[BlockHash, int]


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHashWithGroup | None = None
    is_null: bool = False
    # links of the free queue; None when the block is not in it
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (LRU at the front).

    All operations are O(1), including removing a block from the middle when a prefix
    cache hit revives it. Sentinel head/tail nodes keep the edge cases out of the code.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """All KV blocks of the engine, shared by every KV cache group.

    Block 0 is the null block: it stands in for blocks a sliding-window group has let
    go, pads block tables, and is never cached or freed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 on_evict: Callable[[int, BlockHashWithGroup], None] | None = None) -> None:
        """on_evict(block id, its key): told of each cached block given to new content
        before it is (a host tier keeps a copy)."""
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHashWithGroup, KVCacheBlock] = {}
        self.on_evict = on_evict
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # -- lookup ------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self.cached_blocks.get((block_hash, group_id))

    # -- allocation ---------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pops n free blocks (evicting their cached content, LRU first)."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block.block_id, block.block_hash)
            self.uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits, reviving them from the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops a reference; blocks reaching zero go to the back of the free queue.

        Callers pass a request's blocks tail first, so that the tail of a sequence is
        evicted before its head (the head is the likelier prefix of a future request).
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- caching ------------------------------------------------------------------
    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], group_id: int
    ) -> None:
        """Registers filled blocks under their hashes (a no-op for already cached ones)."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block.is_null:
                continue
            key = (block_hash, group_id)
            block.block_hash = key
            # A duplicate (computed twice concurrently) keeps the first block in the map.
            self.cached_blocks.setdefault(key, block)

    def uncache(self, block: KVCacheBlock) -> None:
        """Forgets a block's hash: no later request can hit it."""
        key = block.block_hash
        if key is None:
            return
        if self.cached_blocks.get(key) is block:
            del self.cached_blocks[key]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only allowed when no block is in use."""
        num_used = self.num_blocks - 1 - self.get_num_free_blocks()
        if num_used > 0:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
