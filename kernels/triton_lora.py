"""LoRA for a batch of mixed adapters on the GPU (Triton): the tokens are ordered by
adapter slot into segments, and two kernels run over (segment, row block, column block):
shrink, y = x A_s^T (tokens x rank, fp32), and expand, out += y B_s^T, each a tiled dot
against the segment's own slot (the gathered-segment scheme of punica / vLLM's
sgmv kernels). Tokens without an adapter are in no segment and are not touched."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlmserve.kernels.lora import LoRAMapping
from vlmserve.kernels.registry import register
from vlmserve.kernels.triton_attention import dot_precision

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _lora_segment_dot(in_ptr, w_ptr, out_ptr, order_ptr, seg_start_ptr, seg_slot_ptr, K, N, slot_stride,
                      ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    """out[t, n] (+)= sum_k in[t, k] * w[slot, n, k] for the tokens t of one segment."""
    seg = tl.program_id(0)
    start, end = tl.load(seg_start_ptr + seg), tl.load(seg_start_ptr + seg + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first < end:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        idx = first + tl.arange(0, BLOCK_M)
        row_ok = idx < end
        rows = tl.load(order_ptr + idx, mask=row_ok, other=0).to(tl.int64)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        cols64 = cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(in_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + slot * slot_stride + cols64[:, None] * K + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
        ptrs = out_ptr + rows[:, None] * N + cols64[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _segments(mapping: LoRAMapping, num_rows: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows with an adapter ordered by slot, where each slot's segment starts, and the
    segments' slots (derived once per forward and row count)."""
    key = ("segments", num_rows)
    if key not in mapping.derived:
        slots = mapping.slots_of(num_rows, device)
        order = torch.argsort(slots, stable=True)
        order = order[slots[order] >= 0].to(torch.int32)
        seg_slots, counts = torch.unique_consecutive(slots[order.long()], return_counts=True)
        starts = torch.zeros(len(counts) + 1, dtype=torch.int32, device=device)
        starts[1:] = torch.cumsum(counts, 0)
        mapping.derived[key] = (order, starts, seg_slots.to(torch.int32))
    return mapping.derived[key]


@register("add_lora", "triton")
def add_lora_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    mapping: LoRAMapping) -> None:
    rows, k = x.shape
    order, starts, seg_slots = _segments(mapping, rows, x.device)
    if not len(order):
        return
    ranks, n = a.shape[1], b.shape[1]
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    y = torch.zeros(rows, ranks, dtype=torch.float32, device=x.device)
    precision = dot_precision(x.dtype)
    m_blocks = triton.cdiv(rows, BLOCK_M)
    _lora_segment_dot[(len(seg_slots), m_blocks, triton.cdiv(ranks, BLOCK_N))](
        x, a, y, order, starts, seg_slots, k, ranks, ranks * k, ACCUMULATE=False,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision)
    _lora_segment_dot[(len(seg_slots), m_blocks, triton.cdiv(n, BLOCK_N))](
        y, b, out, order, starts, seg_slots, ranks, n, n * ranks, ACCUMULATE=True,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision)
