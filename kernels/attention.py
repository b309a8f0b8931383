"""Attention over the paged KV cache (decode and prefill, full or sliding window), and
packed variable-length attention for the vision tower.

KV cache layout, per layer: keys and values of shape [num_blocks, block_size,
num_kv_heads, head_dim]; token t of a request lives in slot
block_table[t // block_size] * block_size + t % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vlmserve.kernels.registry import register


@dataclass
class PrefillSeq:
    """One request with several query tokens this step."""

    query_start: int
    query_len: int
    kv_slots: torch.Tensor | None  # [kv_len] slots of the keys it sees; None: only its own new tokens
    mask: torch.Tensor | None  # [query_len, kv_len] bool (True = visible); None: plain causal


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in one KV cache group and which keys each query sees.

    Built once per step per group by `build_attention_metadata`, shared by the group's
    layers. Requests are laid out decodes first (one query token each), then prefills.
    Decodes read whole blocks (one row copy per block is much cheaper than one per
    token); the mask hides the positions of those blocks a query must not see.
    """

    slot_mapping: torch.Tensor  # [num_tokens] slot of each new token
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [num_decodes, blocks] block ids (null-padded)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, blocks * block_size] bool
    prefills: list[PrefillSeq]


def _slots(block_table: np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end)
    return block_table[pos // block_size] * block_size + pos % block_size


def build_attention_metadata(
    block_tables: list[np.ndarray],
    num_computed: list[int],
    query_lens: list[int],
    block_size: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """block_tables[i]: block ids of request i; it has num_computed[i] tokens in the cache
    and query_lens[i] new ones this step. Requests with query_len 1 must come first."""
    window = sliding_window or 1 << 62
    slot_mapping = np.concatenate(
        [_slots(bt, c, c + q, block_size) for bt, c, q in zip(block_tables, num_computed, query_lens)]
    ) if block_tables else np.zeros(0, dtype=np.int64)

    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    assert all(q > 1 for q in query_lens[num_decodes:]), "decodes must come first"

    decode_blocks = decode_mask = None
    if num_decodes:
        seq_lens = np.array([c + 1 for c in num_computed[:num_decodes]])
        first_visible = np.maximum(seq_lens - window, 0)
        first_block = first_visible // block_size
        last_block = (seq_lens - 1) // block_size
        width = int((last_block - first_block).max()) + 1
        blocks = np.zeros((num_decodes, width), dtype=np.int64)  # 0: the null block
        for i in range(num_decodes):
            row = block_tables[i][first_block[i] : last_block[i] + 1]
            blocks[i, : len(row)] = row
        pos = first_block[:, None] * block_size + np.arange(width * block_size)[None, :]
        mask = (pos >= first_visible[:, None]) & (pos < seq_lens[:, None])
        decode_blocks = torch.from_numpy(blocks).to(device)
        decode_mask = torch.from_numpy(mask).to(device)[:, None, None, :]

    prefills = []
    query_start = num_decodes
    for i in range(num_decodes, len(query_lens)):
        c, q = num_computed[i], query_lens[i]
        q_pos = np.arange(c, c + q)
        kv_start = max(c - window + 1, 0)
        if c == 0 and q <= window:
            kv_slots = mask = None  # attends to its own new tokens only, causally
        else:
            kv_pos = np.arange(kv_start, c + q)
            visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
            mask = torch.from_numpy(visible).to(device)
            kv_slots = None if c == 0 else torch.from_numpy(_slots(block_tables[i], kv_start, c + q, block_size)).to(device)
        prefills.append(PrefillSeq(query_start, q, kv_slots, mask))
        query_start += q
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        num_decodes=num_decodes,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        prefills=prefills,
    )


@register("paged_attention")
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, q_heads, d]; k, v: [tokens, kv_heads, d] (this step's). Writes k/v into
    the cache, then attends. Returns [tokens, q_heads, d]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    row = num_kv_heads * head_dim
    kc = k_cache.view(-1, row)  # one row per slot
    vc = v_cache.view(-1, row)
    # every token of the batch is written before any is read: a request may read blocks
    # another request of this step is filling (a prefix hit on blocks cached this step)
    kc.index_copy_(0, meta.slot_mapping, k.reshape(-1, row))
    vc.index_copy_(0, meta.slot_mapping, v.reshape(-1, row))
    gqa = q.shape[1] != num_kv_heads
    out = torch.empty_like(q)

    nd = meta.num_decodes
    if nd:
        num_blocks, width = k_cache.shape[0], meta.decode_blocks.shape[1]
        flat_blocks = meta.decode_blocks.view(-1)
        keys = k_cache.view(num_blocks, -1).index_select(0, flat_blocks).view(nd, -1, num_kv_heads, head_dim)
        values = v_cache.view(num_blocks, -1).index_select(0, flat_blocks).view(nd, -1, num_kv_heads, head_dim)
        out[:nd] = _decode_attention(q[:nd], keys, values, meta.decode_mask, scale)

    for p in meta.prefills:
        s, e = p.query_start, p.query_start + p.query_len
        if p.kv_slots is None:
            keys, values = k[s:e], v[s:e]
        else:
            keys = kc.index_select(0, p.kv_slots).view(-1, num_kv_heads, head_dim)
            values = vc.index_select(0, p.kv_slots).view(-1, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [B, q_heads, d]; keys/values: [B, L, kv_heads, d]; mask: [B, 1, 1, L].

    Runs torch's fused CPU kernel in fp32: for one query token per sequence it is several
    times faster than its bf16 variant, and the upcast rides on the copy the gather makes.
    The query heads that share a KV head are passed as that head's query positions
    (the mask hides the same keys from all of them): one [group, L] product per KV head
    instead of a GQA broadcast, over 2x faster on CPU.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    o = F.scaled_dot_product_attention(
        q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim),
        keys.float().transpose(1, 2), values.float().transpose(1, 2),
        attn_mask=mask, scale=scale,
    )
    return o.reshape(batch, q_heads, head_dim).to(q.dtype)


@register("varlen_attention")
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention within each of several packed sequences.

    q, k, v: [tokens, heads, d], the sequences back to back. Sequences are padded to the
    longest and attended in one batched call (a per-sequence loop costs more on CPU
    than the padding does for the vision tower's near-equal windows).
    """
    n, heads, d = q.shape
    num_seqs = len(seq_lens)
    longest = max(seq_lens)
    if all(length == longest for length in seq_lens):
        def batch(x):
            return x.view(num_seqs, longest, heads, d).transpose(1, 2)

        o = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), scale=scale)
        return o.transpose(1, 2).reshape(n, heads, d)
    starts = np.cumsum([0] + list(seq_lens[:-1]))
    offsets = np.arange(longest)
    valid = offsets[None, :] < np.asarray(seq_lens)[:, None]
    index = np.where(valid, starts[:, None] + offsets[None, :], 0)
    index_t = torch.from_numpy(index).to(q.device)
    mask = torch.from_numpy(valid).to(q.device)[:, None, None, :]

    def padded(x):
        return x[index_t].transpose(1, 2)  # [seqs, heads, longest, d]

    o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=scale)
    o = o.transpose(1, 2)[torch.from_numpy(valid).to(q.device)]
    return o.reshape(n, heads, d)
