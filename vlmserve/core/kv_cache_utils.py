"""Block hashes for prefix caching.

H_i = xxh3_128(H_{i-1} || token ids of block i || extra keys), full blocks only. The
extra keys are the mm_hash of every media item whose placeholder overlaps block i and,
on block 0, the request's cache_salt and LoRA adapter: the same image at the same place
gives the same chain; a different image behind identical placeholder tokens, or another
adapter, never does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from vlmserve.request import Request

BlockHash = bytes
NONE_HASH: BlockHash = b"\x00" * 16  # parent of block 0


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: list[int] | np.ndarray, extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    h = xxhash.xxh3_128()
    h.update(parent_hash)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for key in extra_keys:
        h.update(b"\x1f")  # separator, so ("ab","c") != ("a","bc")
        h.update(key.encode())
    return h.digest()


def block_extra_keys(request: Request, start: int, end: int) -> tuple[str, ...]:
    keys = [f.mm_hash for f in request.mm_features if f.overlaps(start, end)]
    if start == 0 and request.cache_salt:
        keys.append("salt:" + request.cache_salt)
    if start == 0 and request.lora_request is not None:  # another adapter computes other KV
        keys.append(request.lora_request.cache_key)
    return tuple(keys)


class BlockHasher:
    """Gives the hashes of a request's newly filled blocks (a class, not a closure, so that
    a request can be sent to an engine core in another process)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        start_block = len(request.block_hashes)
        end_block = request.num_tokens // self.block_size
        parent = request.block_hashes[-1] if request.block_hashes else NONE_HASH
        tokens = request.all_token_ids
        new_hashes = []
        for i in range(start_block, end_block):
            start, end = i * self.block_size, (i + 1) * self.block_size
            parent = hash_block_tokens(parent, tokens[start:end], block_extra_keys(request, start, end))
            new_hashes.append(parent)
        return new_hashes
