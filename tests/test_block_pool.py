import pytest

from vlmserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue):
    return [b.block_id for b in queue]


def test_free_queue_popleft_remove_append_in_constant_time_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and ids(q) == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # from the middle
    assert ids(q) == [1, 2, 4, 5] and q.num_free_blocks == 4
    q.append(blocks[3])
    assert ids(q) == [1, 2, 4, 5, 3]
    q.remove(blocks[5])
    q.remove(blocks[1])  # head
    q.remove(blocks[3])  # tail
    assert ids(q) == [2, 4]
    assert [b.block_id for b in q.popleft_n(2)] == [2, 4]
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # not in the queue


def test_block_pool_null_block_caching_and_lru_eviction():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.get_num_free_blocks() == 4
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h" * 16, b"i" * 16], group_id=0)
    assert pool.get_cached_block(b"h" * 16, 0) is a
    assert pool.get_cached_block(b"h" * 16, 1) is None  # groups do not share blocks
    pool.free_blocks([b, a])  # tail first: b is evicted before a
    assert pool.get_num_free_blocks() == 4
    # a cache hit revives a freed block out of the middle of the free queue
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    new = pool.get_new_blocks(3)  # takes the two never-used blocks, then evicts b
    assert b in new and pool.get_cached_block(b"i" * 16, 0) is None
    assert pool.get_cached_block(b"h" * 16, 0) is a
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(new + [a])
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])  # freed twice
    assert pool.reset_prefix_cache() and not pool.cached_blocks
