"""Attention over the paged KV cache (a mixed batch of decodes and prefills, full or
sliding window, grouped-query), and packed variable-length attention for the vision tower.

KV cache layout, per layer: keys [num_blocks, num_kv_heads, head_dim / 2, block_size, 2]
(each block's keys transposed, so that a query's scores against a block are vector
multiply-adds over the block's tokens, with channels in pairs), values [num_blocks,
num_kv_heads, block_size / 2, head_dim, 2] (tokens in pairs): the pairs are what
AVX512-BF16's dot product takes (kernels/csrc/paged_attention.cpp). A block of one head
is contiguous in both. Token t of a request lives in slot block_table[t // block_size] *
block_size + t % block_size: block slot // block_size, offset slot % block_size.

An FP8 KV cache (`--kv-cache-dtype fp8`) has the same layouts in float8 e4m3fn, with a scale
per layer for its keys and one for its values (vLLM's per-tensor k_scale and v_scale: 1.0
unless the checkpoint gives them): a value is stored as x / scale, rounded to the nearest
e4m3 value and saturated at +-448, as vLLM's cache write does, and read back as its number
times the scale. Every implementation takes the scales and ignores them for other caches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.registry import register


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in one KV cache group and which keys each query sees.

    Built once per step per group by `build_attention_metadata`, shared by the group's
    layers. Sequence i has query tokens q[query_start[i]:query_start[i + 1]], the last
    ones of its seq_lens[i] tokens (the cache holds all of them once this step's keys
    are written); its blocks are block_tables[i] (null-padded). A query at position p
    sees the keys at [max(0, p - window + 1), p] (window 0: from 0), or up to
    max(p, key_ends[token]) where key_ends is given: the tokens of a picture that attend
    to each other both ways (Gemma 3) see up to its last token, computed in the same step.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    sliding_window: int  # 0: none
    query_start_host: list[int]  # the same on the host, for the portable implementation
    seq_lens_host: list[int]
    key_ends: torch.Tensor | None = None  # [num_tokens] int32, or None: causal


Upload = Callable[[str, np.ndarray], torch.Tensor]


def _to_cpu(name: str, array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def build_attention_metadata(
    block_tables: np.ndarray | torch.Tensor,
    num_computed: list[int] | np.ndarray,
    query_lens: list[int] | np.ndarray,
    block_size: int,
    sliding_window: int | None = None,
    upload: Upload = _to_cpu,
    key_ends: np.ndarray | None = None,
) -> AttentionMetadata:
    """block_tables[i]: block ids of request i (2-D, null-padded; already on the device,
    or a host array); it has num_computed[i] tokens in the cache and query_lens[i] new
    ones this step. `upload` puts the step's host arrays on the device (the runner's
    staging; the default keeps them on the CPU). key_ends: see AttentionMetadata."""
    num_computed = np.asarray(num_computed, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    pos = np.arange(int(query_start[-1])) - query_start[seq_of_token] + num_computed[seq_of_token]
    if isinstance(block_tables, torch.Tensor):  # on the device already: the slots computed there
        seq_t, pos_t = upload("seq_of_token", seq_of_token), upload("token_positions", pos)
        slots = block_tables[seq_t, pos_t // block_size].long() * block_size + pos_t % block_size
    else:  # host arrays: the slots too, then both uploaded
        host_tables = np.asarray(block_tables, dtype=np.int32).reshape(len(query_lens), -1)
        slots = upload("slot_mapping", host_tables[seq_of_token, pos // block_size].astype(np.int64) * block_size
                       + pos % block_size)
        block_tables = upload("block_tables", host_tables)
    seq_lens = num_computed + query_lens
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=block_tables,
        query_start=upload("query_start", query_start.astype(np.int32)),
        seq_lens=upload("seq_lens", seq_lens.astype(np.int32)),
        sliding_window=int(sliding_window or 0),
        query_start_host=query_start.tolist(),
        seq_lens_host=seq_lens.tolist(),
        key_ends=None if key_ends is None else upload("key_ends", key_ends.astype(np.int32)),
    )


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one layer's key and value caches (see the module's docstring)."""
    if head_dim % 2 or block_size % 2:
        raise ValueError(f"head size {head_dim} and block size {block_size} must be even")
    return ((num_blocks, num_kv_heads, head_dim // 2, block_size, 2),
            (num_blocks, num_kv_heads, block_size // 2, head_dim, 2))


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as an FP8 cache stores it: rounded to nearest even, saturated (a plain cast
    would make values past +-448 NaNs)."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 cache's values as the numbers they stand for, in dtype."""
    return (x.float() * scale).to(dtype)


def _key_view(k_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, num_kv_heads, head_dim / 2, 2]: a token's keys by (block, offset)."""
    return k_cache.permute(0, 3, 1, 2, 4)


def _value_view(v_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size / 2, 2, num_kv_heads, head_dim]: a token's values by (block, offset // 2, offset % 2)."""
    return v_cache.permute(0, 2, 4, 1, 3)


def read_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [n, num_kv_heads, head_dim] of the tokens at (blocks, offsets)."""
    keys = _key_view(k_cache)[blocks, offsets]
    return keys.reshape(*keys.shape[:2], -1), _value_view(v_cache)[blocks, offsets // 2, offsets % 2]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Stores this step's keys and values at their slots (an FP8 cache's quantized by its
    scales). Every token of the batch is written before any is read: a request may read
    blocks another request of this step is filling (a prefix hit on blocks cached this step)."""
    if k_cache.dtype == FP8_KV_DTYPE:
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    block_size = k_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    _key_view(k_cache)[blocks, offsets] = k.view(*k.shape[:2], k.shape[2] // 2, 2)
    _value_view(v_cache)[blocks, offsets // 2, offsets % 2] = v


@register("paged_attention")
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [tokens, q_heads, d]; k, v: [tokens, kv_heads, d] (this step's). Writes k/v into
    the cache, then attends. Returns [tokens, q_heads, d]. k_scale, v_scale: an FP8
    cache's (see the module's docstring).

    The portable version (and the reference of the others): each sequence's visible keys
    gathered from the cache, then torch's attention with an explicit mask."""
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    num_kv_heads = k.shape[1]
    block_size = k_cache.shape[3]
    window = meta.sliding_window or 1 << 62
    out = torch.empty_like(q)
    starts = meta.query_start_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        s, e = starts[i], starts[i + 1]
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        last = q_pos if meta.key_ends is None else torch.maximum(q_pos, meta.key_ends[s:e].long())
        first = max(seq_len - (e - s) - window + 1, 0)
        kv_pos = torch.arange(first, seq_len, device=q.device)
        keys, values = read_kv_cache(k_cache, v_cache, meta.block_tables[i].long()[kv_pos // block_size],
                                     kv_pos % block_size)
        if fp8:
            keys, values = dequantize_kv(keys, k_scale), dequantize_kv(values, v_scale)
        visible = (kv_pos[None, :] <= last[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0).float(),
            keys.transpose(0, 1).unsqueeze(0).float(),
            values.transpose(0, 1).unsqueeze(0).float(),
            attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != num_kv_heads,
        )
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out


# On CPUs with AMX, prompt chunks of at least this many tokens take torch's flash attention
# (AMX/oneDNN tiles) instead of the paged kernel's vector dot products: at 16 heads of 128,
# 2 threads, 2.1x on a 1,419-token prompt, 3.4x on 4,096, 2.7x on 2,048 over a 2,048-token
# prefix; at 256 tokens 2.0x (1.4x over a 1,024-token prefix), at 128 still 1.4x: chunks
# below stay on the paged kernel with the decodes, in its one call. Without AMX (AVX512-BF16
# alone) it is the other way round: the paged kernel ran 2.0-2.9x faster than torch's flash
# attention at every size measured (heads of 64, 8 / 2, and of 128, 16 / 2; prompts of 256
# to 4,096 tokens, 1,000 over 1,000, 2,048 over 2,048), so there every chunk stays on it.
FLASH_MIN_QUERY = 256


def flash_threshold() -> int | None:
    """The chunk length from which this CPU's prompt chunks take flash attention (None: never)."""
    return FLASH_MIN_QUERY if cpu_extension.has_amx() else None


@register("paged_attention", "cpu", available=cpu_extension.available)
def paged_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0
                        ) -> torch.Tensor:
    """The C++ kernel (kernels/csrc/paged_attention.cpp): the cache read in place, fp32
    accumulation; on CPUs with AMX, long prompt chunks by torch's flash attention."""
    return attend_cpu(q, k, v, k_cache, v_cache, meta, scale, flash_threshold(), k_scale, v_scale)


def attend_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, flash_from: int | None, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
    """paged_attention_cpu with the chunk length from which prompt chunks (causal, no
    window) take torch's flash attention (`_flash_prefill`) given; None: none do."""
    cpu_kernels().write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    starts = meta.query_start_host
    long = [i for i in range(len(meta.seq_lens_host)) if starts[i + 1] - starts[i] >= flash_from] \
        if flash_from is not None and meta.sliding_window == 0 and meta.key_ends is None else []
    if not long:
        return cpu_kernels().paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start,
                                             meta.seq_lens, meta.sliding_window, scale, meta.key_ends, k_scale,
                                             v_scale)
    out = torch.empty_like(q)
    rest = [i for i in range(len(meta.seq_lens_host)) if i not in long]
    if rest:  # the decodes and short chunks of the batch, on the paged kernel
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rest])
        lens = [starts[i + 1] - starts[i] for i in rest]
        query_start = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
        picked = torch.tensor(rest)
        out[rows] = cpu_kernels().paged_attention(q[rows], k_cache, v_cache, meta.block_tables[picked],
                                                  query_start, meta.seq_lens[picked], 0, scale, None, k_scale,
                                                  v_scale)
    for i in long:
        s, e = starts[i], starts[i + 1]
        out[s:e] = _flash_chunk(q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta.block_tables[i].long(),
                                meta.seq_lens_host[i], scale, k_scale, v_scale)
    return out


def _flash_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 blocks: torch.Tensor, seq_len: int, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """_flash_prefill of one sequence's chunk (its queries, keys and values q, k, v; its
    blocks) over its cached prefix, read from the cache; over an FP8 cache, the chunk's own
    keys and values too, as the cache holds them (what the paged kernel attends to)."""
    block_size, prefix = k_cache.shape[3], seq_len - q.shape[0]
    if k_cache.dtype == FP8_KV_DTYPE:
        kv_pos = torch.arange(seq_len)
        keys, values = read_kv_cache(k_cache, v_cache, blocks[kv_pos // block_size], kv_pos % block_size)
        keys, values = dequantize_kv(keys, k_scale, q.dtype), dequantize_kv(values, v_scale, q.dtype)
        cached = (keys[:prefix], values[:prefix]) if prefix else None
        return _flash_prefill(q, keys[prefix:], values[prefix:], cached, scale)
    kv_pos = torch.arange(prefix)
    cached = read_kv_cache(k_cache, v_cache, blocks[kv_pos // block_size], kv_pos % block_size) if prefix else None
    return _flash_prefill(q, k, v, cached, scale)


def _flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cached: tuple[torch.Tensor, torch.Tensor] | None, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's chunk q [n, heads, d] over its own keys k, v
    [n, kv_heads, d] and, when given, the keys and values of its cached prefix (all of
    them visible): the two parts by flash attention, joined by their log-sum-exps."""
    heads = q.shape[1]
    if cached is None:  # torch's own grouped-query path (no copies of k and v per head)
        own = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),  # 4-D: flash
                                             is_causal=True, scale=scale, enable_gqa=heads != k.shape[1])
        return own[0].transpose(0, 1)

    def batched(x: torch.Tensor) -> torch.Tensor:  # [n, h, d] -> [1, heads, n, d]
        return x.repeat_interleave(heads // x.shape[1], dim=1).transpose(0, 1).unsqueeze(0)

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # the one that gives the log-sum-exps
    own, own_lse = flash(batched(q), batched(k), batched(v), 0.0, True, scale=scale)
    before, before_lse = flash(batched(q), batched(cached[0]), batched(cached[1]), 0.0, False, scale=scale)
    top = torch.maximum(own_lse, before_lse)
    w_own, w_before = (own_lse - top).exp(), (before_lse - top).exp()
    joined = (own.float() * w_own[..., None] + before.float() * w_before[..., None]) / (w_own + w_before)[..., None]
    return joined[0].transpose(0, 1).to(q.dtype)


@register("varlen_attention")
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention within each of several packed sequences.

    q, k, v: [tokens, heads, d], the sequences back to back. Sequences of one length are
    attended in one batched call (a per-sequence loop costs more on CPU than batching).
    Sequences of several lengths are padded to the longest and attended in one call with
    a mask where padding adds little (a window's edge windows), and attended in one call
    per length where it would add much (the full-attention blocks of pictures of several
    sizes: 2.2x on 40 pictures of 6 sizes; windows of 16 and fewer patches: padded 1.1x).
    """
    n, heads, d = q.shape
    longest = max(seq_lens)
    if len(set(seq_lens)) == 1:
        return _equal_length_attention(q, k, v, longest, scale)
    if len(seq_lens) * longest**2 > PADDING_LIMIT * sum(length * length for length in seq_lens):
        return _attention_by_length(q, k, v, seq_lens, scale)
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


def _bf16_dot_kernels() -> bool:
    return cpu_extension.has_bf16_dot() and cpu_extension.available()


@register("varlen_attention", "cpu", available=_bf16_dot_kernels)
def varlen_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """bf16: the C++ kernel (kernels/csrc/varlen_attention.cpp), both products on the CPU's
    bf16 dot product, where torch's flash attention runs at fp32 speed. Other dtypes, and
    on CPUs with AMX the calls whose longest sequence has VARLEN_TORCH_FROM patches or
    more: torch, whose flash attention multiplies on the AMX tiles there (Xeon with AMX, 2
    threads: 33 pictures' full attention, 169-529 patches, 2.3x the kernel's speed; 8
    pictures of 1,024-2,304 patches, heads 16 x 80, 3.7x)."""
    if q.dtype != torch.bfloat16 or (cpu_extension.has_amx() and max(seq_lens) >= VARLEN_TORCH_FROM):
        return varlen_attention(q, k, v, seq_lens, scale)
    return varlen_attention_kernel(q, k, v, seq_lens, scale)


def varlen_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
                            ) -> torch.Tensor:
    """The C++ kernel alone (bf16, AVX512-BF16)."""
    cu_seqlens = torch.from_numpy(np.cumsum([0, *seq_lens]))
    return cpu_kernels().varlen_attention(q, k, v, cu_seqlens, scale)


# On CPUs with AMX, calls whose longest sequence has this many patches take torch's flash
# attention; shorter windows stay on the kernel (one call, no gathers by length). Measured
# (medians of 6): the small Qwen2.5-VL's 32-picture batch (windows of 16 patches, full
# attention over 169-529) 94 ms a call, against 106 with the kernel everywhere and 103
# with torch everywhere; a 1-megapixel picture through Qwen2.5-VL-3B's tower (8 layers:
# windows of 64 patches, one block of full attention over 5,184) 2.05 s with the kernel,
# 1.59 with torch from 128 patches, 1.38 from 64.
VARLEN_TORCH_FROM = 64

# padded attention may do at most this many times the work of the sequences' own
PADDING_LIMIT = 1.5


def _attention_by_length(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
                         ) -> torch.Tensor:
    """One batched call per sequence length: the sequences sorted by length (one gather
    each of q, k, v), so that each length's are one contiguous run."""
    n = q.shape[0]
    lens = np.asarray(seq_lens)
    order = np.argsort(lens, kind="stable")
    sorted_lens = lens[order]
    sorted_starts = np.cumsum(sorted_lens) - sorted_lens
    source_starts = (np.cumsum(lens) - lens)[order]
    rows = torch.from_numpy(np.arange(n) + np.repeat(source_starts - sorted_starts, sorted_lens)).to(q.device)
    qs, ks, vs = q[rows], k[rows], v[rows]
    by_length = torch.empty_like(qs)
    lengths, counts = np.unique(sorted_lens, return_counts=True)
    begin = 0
    for length, count in zip(lengths.tolist(), counts.tolist()):
        end = begin + length * count
        by_length[begin:end] = _equal_length_attention(qs[begin:end], ks[begin:end], vs[begin:end], length, scale)
        begin = end
    out = torch.empty_like(q)
    out[rows] = by_length
    return out


def _equal_length_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float
                            ) -> torch.Tensor:
    n, heads, d = q.shape

    def batch(x):
        return x.view(n // length, length, heads, d).transpose(1, 2)

    o = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), scale=scale)
    return o.transpose(1, 2).reshape(n, heads, d)
