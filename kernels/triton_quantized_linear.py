"""Triton matmul on weight-only quantized weights (the GPU path): each program computes a
tile of outputs, dequantizing its tile of int8, int4 or fp8 weights in registers (fp32)
right before the dot, so the weight crosses memory at its quantized size once per tile.
fp8 (e4m3) bytes are converted through fp16's bit layout, which needs no FP8 support in
the GPU (or in the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlmserve.kernels.quantized_linear import QuantizedWeight
from vlmserve.kernels.registry import register
from vlmserve.kernels.triton_attention import dot_precision

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _quantized_matmul_kernel(x_ptr, data_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, M, N, K, groups, group,
                             INT4: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not INT4 and not FP8:
        scale = tl.load(scales_ptr + cols64, mask=col_ok, other=0.0).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows64[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        ok = col_ok[:, None] & k_ok[None, :]
        if INT4:  # two values a byte: input 2j low nibble, 2j + 1 high; w = q * scale + zero per group
            byte = tl.load(data_ptr + cols64[:, None] * (K // 2) + ks[None, :] // 2, mask=ok, other=0).to(tl.int32)
            q = ((byte >> ((ks[None, :] % 2) * 4)) & 15).to(tl.float32)
            g = cols64[:, None] * groups + ks[None, :] // group
            w = q * tl.load(scales_ptr + g, mask=ok, other=0.0).to(tl.float32) \
                + tl.load(zeros_ptr + g, mask=ok, other=0.0).to(tl.float32)
        elif FP8:  # e4m3 bits in fp16's places are the value times 2^-8 (subnormals too)
            byte = tl.load(data_ptr + cols64[:, None] * K + ks[None, :], mask=ok, other=0).to(tl.uint16)
            half = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
            g = cols64[:, None] * groups + ks[None, :] // group
            w = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0 \
                * tl.load(scales_ptr + g, mask=ok, other=0.0).to(tl.float32)
        else:
            q = tl.load(data_ptr + cols64[:, None] * K + ks[None, :], mask=ok, other=0).to(tl.float32)
            w = q * scale[:, None]
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols64, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64[:, None] * N + cols64[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@register("quantized_linear", "triton")
def quantized_linear_triton(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out_features, in_features = qw.shape
    flat = x.reshape(-1, in_features).contiguous()
    out = torch.empty(flat.shape[0], out_features, dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        int4, fp8 = qw.method == "int4", qw.method == "fp8"
        grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(out_features, BLOCK_N))
        _quantized_matmul_kernel[grid](
            flat, qw.data.view(torch.uint8) if fp8 else qw.data, qw.scales, qw.zeros if int4 else qw.scales,
            bias if bias is not None else flat, out, flat.shape[0], out_features, in_features,
            in_features // qw.group if int4 else qw.scales.shape[1] if fp8 else 1, qw.group,
            INT4=int4, FP8=fp8, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION=dot_precision(x.dtype))
    return out.view(*x.shape[:-1], out_features)
