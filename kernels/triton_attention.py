"""Triton kernels for attention: paged attention over the KV cache for a mixed batch of
decodes and prefills (sliding window, GQA, the cache's pair layouts: see attention.py),
the KV-cache write, and the vision tower's packed variable-length attention.

Registered for the "triton" implementations (CUDA, or CPU tensors under
TRITON_INTERPRET=1, where they are tested in fp32: the interpreter has no bf16 dot).
Scores and the softmax run in fp32 whatever the storage dtype. FP8 caches (attention.py):
read by the GPU's own conversion (compute capability 8.9 and later), written by integer
arithmetic that rounds as torch and vLLM's cache write do (the interpreter's float-to-fp8
conversion rounds ties away from zero and drops subnormals).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlmserve.kernels.attention import FP8_KV_DTYPE, AttentionMetadata
from vlmserve.kernels.registry import register

BLOCK_M = 16  # query tokens per program


def dot_precision(dtype: torch.dtype) -> str:
    """The precision of the kernels' fp32 dots: fp32 storage asks for fp32 products (a
    GPU's default for fp32 dots is tf32, which would not give fp32 results); bf16/fp16
    values upcast to fp32 are exact in tf32, so their dots take the tensor cores' tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _load_kv_block(k_ptr, v_ptr, dims, dim_ok, offsets, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One cache block's keys (transposed, [D, BS]) and values ([BS, D]) of one head, in fp32."""
    # keys [D / 2, BS, 2]: channel d of token t at (d // 2) * 2 * BS + 2 * t + d % 2
    k_off = (dims[:, None] // 2) * (2 * BLOCK_SIZE) + 2 * offsets[None, :] + dims[:, None] % 2
    keys_t = tl.load(k_ptr + k_off, mask=dim_ok[:, None], other=0.0).to(tl.float32)
    # values [BS / 2, D, 2]: token t, channel d at (t // 2) * 2 * D + 2 * d + t % 2
    v_off = (offsets[:, None] // 2) * (2 * HEAD_DIM) + 2 * dims[None, :] + offsets[:, None] % 2
    values = tl.load(v_ptr + v_off, mask=dim_ok[None, :], other=0.0).to(tl.float32)
    return keys_t, values


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, key_ends_ptr,
    scale, window, bt_stride, num_q_heads, num_kv_heads, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    KEY_ENDS: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """One program: BLOCK_M query tokens of one sequence, one query head. With KEY_ENDS,
    a query sees keys up to max(its position, key_ends[token]) (see AttentionMetadata)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // (num_q_heads // num_kv_heads)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + ((q_start + rows)[:, None] * num_q_heads + head) * HEAD_DIM + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    pos = seq_len - q_len + rows  # each query's position
    first_pos = seq_len - q_len + tile * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M, seq_len) - 1
    key_end = pos
    if KEY_ENDS:
        ends = tl.load(key_ends_ptr + q_start + rows, mask=row_ok, other=0)
        key_end = tl.minimum(tl.maximum(pos, ends), seq_len - 1)
        last_pos = tl.max(tl.where(row_ok, key_end, 0), axis=0)
    lo = 0
    if window > 0:
        lo = tl.maximum(first_pos - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for b in range(lo // BLOCK_SIZE, last_pos // BLOCK_SIZE + 1):
        block = tl.load(block_tables_ptr + seq * bt_stride + b).to(tl.int64)
        base = (block * num_kv_heads + kv_head) * HEAD_DIM * BLOCK_SIZE
        keys_t, values = _load_kv_block(k_cache_ptr + base, v_cache_ptr + base, dims, dim_ok, offsets, HEAD_DIM,
                                        BLOCK_SIZE)
        scores = tl.dot(q, keys_t, input_precision=PRECISION) * scale  # [M, BS]
        key_pos = b * BLOCK_SIZE + offsets
        visible = (key_pos[None, :] <= key_end[:, None]) & row_ok[:, None]
        if window > 0:
            visible = visible & (key_pos[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, -1e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(visible, tl.exp(scores - m_new[:, None]), 0.0)
        correction = tl.exp(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p, values, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if FP8:  # FP8 caches: the keys' scale is in `scale`, the values' goes on the output
        out = out * v_scale
    tl.store(out_ptr + ((q_start + rows)[:, None] * num_q_heads + head) * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _fp8_bits(x, scale):
    """x / scale as the bits (uint8) of the nearest float8 e4m3fn value, ties to even,
    saturated at +-448; NaN stays NaN."""
    y = x.to(tl.float32) / scale
    sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.uint32, bitcast=True)
    # from 2^-6 up: 3 mantissa bits rounded to nearest even, the exponent's bias 127 -> 7
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # below, multiples of 2^-9: rounded to nearest even by adding 2^23 in fp32
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    magnitude = tl.where(y != y, 0x7F, tl.where(a < 0.015625, subnormal, normal))
    return (sign | magnitude).to(tl.uint8)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads, k_scale, v_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """One program: one token's keys and values of one head, into the pair layouts (FP8:
    caches as bytes, each value quantized by its scale). A negative slot is a padding row
    (a CUDA graph's batch rounded up): nothing is written."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dims = tl.arange(0, BLOCK_D)
    ok = dims < HEAD_DIM
    src = (token * num_kv_heads + head) * HEAD_DIM + dims
    base = (block * num_kv_heads + head) * HEAD_DIM * BLOCK_SIZE
    keys = tl.load(k_ptr + src, mask=ok)
    values = tl.load(v_ptr + src, mask=ok)
    if FP8:
        keys, values = _fp8_bits(keys, k_scale), _fp8_bits(values, v_scale)
    tl.store(k_cache_ptr + base + (dims // 2) * (2 * BLOCK_SIZE) + 2 * offset + dims % 2, keys, mask=ok)
    tl.store(v_cache_ptr + base + (offset // 2) * (2 * HEAD_DIM) + 2 * dims + offset % 2, values, mask=ok)


def write_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    if fp8:  # written as bytes (_fp8_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _write_kv_kernel[(tokens, heads)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping, heads,
                                      float(k_scale), float(v_scale), HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
                                      BLOCK_SIZE=k_cache.shape[3], FP8=fp8)


@register("paged_attention", "triton")
def paged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs = len(meta.seq_lens_host)
    starts = meta.query_start_host
    max_q = max((starts[i + 1] - starts[i] for i in range(num_seqs)), default=0)
    if num_seqs == 0 or max_q == 0:
        return out
    dim = q.shape[2]
    grid = (num_seqs, q.shape[1], triton.cdiv(max_q, BLOCK_M))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start, meta.seq_lens,
        meta.seq_lens if meta.key_ends is None else meta.key_ends, scale * k_scale if fp8 else scale,
        meta.sliding_window, meta.block_tables.shape[1], q.shape[1], k_cache.shape[1], float(v_scale),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_SIZE=k_cache.shape[3], BLOCK_M=BLOCK_M,
        KEY_ENDS=meta.key_ends is not None, PRECISION=dot_precision(q.dtype), FP8=fp8,
    )
    return out


@triton.jit
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr, scale, num_heads,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One program: BLOCK_M queries of one packed sequence, one head; every key of the
    sequence is visible (bidirectional)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    if tile * BLOCK_M >= length:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + ((start + rows)[:, None] * num_heads + head) * HEAD_DIM + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        kv_off = ((start + cols)[:, None] * num_heads + head) * HEAD_DIM + dims[None, :]
        keys = tl.load(k_ptr + kv_off, mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        values = tl.load(v_ptr + kv_off, mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        scores = tl.where(col_ok[None, :], scores, -1e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(col_ok[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        correction = tl.exp(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p, values, input_precision=PRECISION)
        m_i = m_new
    tl.store(out_ptr + ((start + rows)[:, None] * num_heads + head) * HEAD_DIM + dims[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@register("varlen_attention", "triton")
def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                            scale: float) -> torch.Tensor:
    n, heads, dim = q.shape
    out = torch.empty_like(q)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
    grid = (len(seq_lens), heads, triton.cdiv(max(seq_lens), BLOCK_M))
    _varlen_attention_kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), out, cu.to(q.device), scale, heads,
                                   HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_M=BLOCK_M, BLOCK_N=32,
                                   PRECISION=dot_precision(q.dtype))
    return out
