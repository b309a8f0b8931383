"""Linear layers, optionally on a prepacked copy of the weight, and the gated activation
between a gated MLP's two matmuls.

On CPU a weight can be reordered once into a layout its matmul reads faster than the
plain one. With AMX, oneDNN's blocked layout: a matmul on it runs faster than `F.linear`
on the plain weight at every row count measured (fp32 decoding 3-8x, bf16 batched decode
1.3-2x) and as fast for long prefills; only vlmserve's bf16 GEMV on the plain weight beats
it, at one to three rows, and up to 32 rows (a batch of decoding requests) vlmserve's AMX
kernel (csrc/amx_linear.cpp) reads the plain weight once for all rows, as a decode step
should. So there a packed layer keeps both and picks by row count.
Without AMX, a bf16 layer's packed copy is vlmserve's pair layout
(csrc/bf16_batch_linear.cpp: 64 output columns' weights interleaved by input pairs), and
it takes the plain weight's place: one copy serves every row count. With AVX512-BF16 its
kernel streams the copy in one sequential run a thread, which from one row on reads faster
than the bf16 GEMV's four rows at once (1-5 rows 1.0-2.2x, 54-64 GB/s where a 1 GiB sum
reads 46), and with reads ahead, so that reading and computing overlap, from 7 rows on.
A CPU without AVX512-BF16 has no bf16 arithmetic: on AVX2 (AMD Zen 2/3, Intel client
cores) oneDNN has no bf16 matmul (torch's runs at a tenth of fp32's speed), on AVX-512F alone
(Xeons from Skylake to Ice Lake, or a newer one whose hypervisor hides AVX512-BF16) oneDNN
emulates one at a quarter of fp32's speed. There the same kernel multiplies the pairs
widened to fp32 in registers. A layer whose output is no multiple of 64 has no packed
copy: it runs on the bf16 GEMV (1-16 rows), or without AVX512-BF16 on the widening GEMV
(the plain weight widened in registers; up to 64 rows) and beyond as fp32 matmuls over the
weight widened a block at a time.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.huge_pages import zeros_on_huge_pages
from vlmserve.kernels.registry import register

# Up to this many rows the bf16 GEMV on the plain weight beats oneDNN's packed copy (1-3
# rows: 13.1-16.4 against 15.1-17.3 ms for a 3B layer's matrices x 4; at 4 rows the packed
# copy 14.6-16.7 against 16.2-17.3). Wherever the GEMV does not apply, a layer's packed copy
# beats F.linear on the plain weight at every row count measured: bf16 4-7 rows 14.6-18.3
# against 22.5-24.3 ms, fp32 1-4 rows 4.5-5.8 against 13.7-45 ms for one layer's matrices
# (AMD EPYC, 2 threads)
GEMV_OVER_PACKED_ROWS = 3
GEMV_MAX_ROWS = 4  # the int8 matrix-vector kernel's rows (csrc/gemv_int8.cpp)
# Up to this, the bf16 GEMV takes a layer with no packed copy (an output size no multiple of
# 64, or oneDNN's copies too large to keep beside the weights): 4 to 16 rows in tiles,
# 1.2-1.3x F.linear on the plain weight (measured as above; about even at 24-32 rows,
# where F.linear's matmul takes over)
BF16_GEMV_MAX_ROWS = 16
# Past GEMV_OVER_PACKED_ROWS up to this, AMX tiles on the plain weight (csrc/amx_linear.cpp) where
# the CPU has AMX-BF16: a batched decode step at 8-16 rows 1.1-1.5x faster in the engine than
# on oneDNN's packed copy, about even at 32-48, slower at 64 (measured, Qwen2.5-VL-3B widths)
AMX_MAX_ROWS = 32
# Output columns per block of the pair layout a bf16 layer's packed copy takes on CPUs
# without AMX (csrc/bf16_batch_linear.cpp): it streams the weight once (from 7 rows on
# asking for the stream ahead), where oneDNN's matmul on its own copy reads and computes
# in turn (Qwen2.5-VL-3B's matrices, 2 threads, AMD EPYC: 4-64 rows 1.05-1.5x; prompts 128
# rows at a time, about even at 0.9 TFLOP/s)
PAIR_COLUMNS = 64
# Up to this, the widening GEMV (csrc/bf16_gemv_widened.h) on CPUs without AVX512-BF16
# (Qwen2.5-VL-3B's matrices, 2 threads): on AVX2 (AMD EPYC Zen 3) 1.6-3.3x torch's bf16
# F.linear at 1-16 rows, 1.6-1.8x the widened fp32 matmul at 32-64, about even at 128-256;
# on AVX-512F alone (a Xeon without AVX512-BF16) 1.2-3.4x oneDNN's emulated bf16 matmul on its
# packed copy at 1-64 rows, 1.3x the widened fp32 matmul at 64 rows (200 against 152 GFLOP/s),
# 0.6x at 128
WIDENING_GEMV_MAX_ROWS = 64
WIDEN_BLOCK = 1 << 23  # weights widened to fp32 per matmul (32 MB: one buffer, reused)


@register("zeros_streamed")
def zeros_streamed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Memory that decode steps stream through, zero-filled: a weight every step reads
    whole, a KV cache whose blocks each step's attention reads (masked positions included:
    they must hold finite numbers, 0 * NaN is NaN)."""
    return torch.zeros(shape, dtype=dtype, device=device)


@register("zeros_streamed", "cpu")
def zeros_streamed_cpu(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """On 2 MB pages: the bf16 GEMV streams a layer's matrices and the output head 11-20%
    faster from them (Qwen2.5-VL-3B widths, 2 threads, AMD EPYC: 60 -> 68-72 GB/s); a
    batch's attention reads its KV blocks (4 KB each a head) 10-20% faster, and the matmuls
    between keep their TLB entries (32 chats at 3B widths, an AMX Xeon: 5-15% less
    time a decode step). Zero-filled by the kernel as each page is first touched."""
    return zeros_on_huge_pages(shape, dtype)


@register("pack_linear_weight")
def pack_linear_weight(weight: torch.Tensor, in_place: bool = False) -> torch.Tensor | None:
    """No packed layout off the CPU: the plain weight is used."""
    return None


@register("pack_linear_weight", "cpu")
def pack_linear_weight_cpu(weight: torch.Tensor, in_place: bool = False) -> torch.Tensor | None:
    """bf16 on a CPU with AVX-512 or AVX2 and no AMX: the pair layout of vlmserve's kernel
    (`bf16_batch_linear.cpp`), on 2 MB pages, or with `in_place` in the weight's own memory
    (where the copy takes the weight's place and nothing else reads it: loading then never
    holds a layer twice); otherwise oneDNN's blocked layout, except for bf16 where bf16
    layers run widened (none)."""
    if _pairs_fit(weight):
        n, k = weight.shape
        shape = (n // PAIR_COLUMNS, k // 2, PAIR_COLUMNS, 2)
        packed = weight.detach().view(shape) if in_place and weight.is_contiguous() else \
            zeros_on_huge_pages(shape, torch.bfloat16)
        cpu_kernels().bf16_pair_pack(weight.detach(), packed)
        return packed
    if weight.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and widens_bf16_layers():
        return None  # bf16 layers run widened to fp32 on this CPU
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


@register("packed_copy_replaces_weight")
def packed_copy_replaces_weight(weight: torch.Tensor) -> bool:
    """Whether the layer's packed copy (pack_linear_weight) serves every row count, so that
    the plain weight can go once it is made: nowhere off the CPU."""
    return False


@register("packed_copy_replaces_weight", "cpu")
def packed_copy_replaces_weight_cpu(weight: torch.Tensor) -> bool:
    """A bf16 layer's pair-layout copy does (no AMX), against the plain weight's kernels
    (2 threads): with AVX512-BF16 (an AMD EPYC Zen 4, Qwen2.5-VL-3B's and Qwen3.5's
    matrices) 1-5 rows at 1.0-2.2x the bf16 GEMV, 8-64 rows 1.05-1.5x oneDNN's packed copy,
    prompts as fast; on a Xeon with AVX-512F only one row at 0.95x the widening GEMV's speed,
    two or three rows 1.1x, 8-64 rows 1.3-1.6x, prompts 1.1-1.2x the widened fp32 matmul at
    256 rows, 0.92-0.96x from 1,024; on an AVX2 EPYC one row 0.93-1.07x (noise), 8-64 rows
    1.15-1.8x, prompts of 512-2,048 rows 1.2-1.3x. So one copy, not two, is kept."""
    return _pairs_fit(weight)


def is_pair_layout(packed: torch.Tensor | None) -> bool:
    """Whether a layer's packed copy is the pair layout ([N / 64, K / 2, 64, 2]; oneDNN's is 2-D)."""
    return packed is not None and packed.dim() == 4


@register("weight_rows")
def weight_rows(ids: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` of a layer's weight (an embedding lookup in a table tied to the output
    head): the plain weight's."""
    return F.embedding(ids, weight)


@register("weight_rows", "cpu")
def weight_rows_cpu(ids: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """From the pair-layout copy where it took the weight's place: row r is the r % 64th
    column of block r // 64, each of its pairs 4 bytes (a 4,096-token prompt's lookup in
    a 151,936 x 2,048 table: 19 ms, against 1.6 from the plain table)."""
    if not is_pair_layout(packed):
        return F.embedding(ids, weight)
    blocks, pairs, columns, _ = packed.shape
    flat = ids.reshape(-1)
    rows = packed.view(blocks, pairs, columns * 2).view(torch.int32)[flat // columns, :, flat % columns]
    return rows.view(packed.dtype).view(*ids.shape, pairs * 2)


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@register("linear", "cpu")
def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if is_pair_layout(packed):  # the pair-layout copy, in the plain weight's place
        return cpu_kernels().bf16_batch_linear(x, packed, bias)
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and rows > 0 and widens_bf16_layers():
        if rows <= WIDENING_GEMV_MAX_ROWS and _widening_gemv_fits(weight):
            return cpu_kernels().bf16_gemv(x, weight, bias)
        return _linear_widened(x, weight, bias)
    gemv = 0 < rows <= BF16_GEMV_MAX_ROWS and _gemv_fits(x, weight)
    if gemv and rows <= GEMV_OVER_PACKED_ROWS:
        return cpu_kernels().bf16_gemv(x, weight, bias)
    if 0 < rows <= AMX_MAX_ROWS and _amx_fits(x, weight):
        return cpu_kernels().amx_linear(x, weight, bias)
    if packed is not None and rows > 0:  # oneDNN's blocked layout
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])
    if gemv:
        return cpu_kernels().bf16_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


_widened: list[torch.Tensor] = []  # one fp32 buffer for every layer's widened weight block


def reusable_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Scratch memory that calls reuse, written in place inside and outside inference mode
    (a tensor made inside it cannot be written in place outside: an engine's buffer, then a
    plain forward in the same process)."""
    with torch.inference_mode(False):
        return torch.empty(numel, dtype=dtype)


def _linear_widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for bf16 x and W as fp32 matmuls, W widened a block of rows at a time into
    one reused buffer (a 151,936-row head widened whole would take 1.2 GB); one rounding."""
    flat = x.reshape(-1, x.shape[-1]).float()
    n, k = weight.shape
    step = max(1, WIDEN_BLOCK // k)
    if not _widened or _widened[0].numel() < min(n, step) * k:
        _widened[:] = [reusable_buffer(min(n, step) * k, torch.float32)]
    out = torch.empty(flat.shape[0], n)
    for n0 in range(0, n, step):
        block = weight[n0 : n0 + step]
        torch.mm(flat, _widened[0][: block.numel()].view(block.shape).copy_(block).t(), out=out[:, n0 : n0 + step])
    if bias is not None:
        out += bias
    return out.to(x.dtype).view(*x.shape[:-1], n)


def _amx_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and weight.shape[0] % 32 == 0
            and weight.shape[1] % 32 == 0 and weight.is_contiguous() and cpu_extension.has_amx())


def _pairs_fit(weight: torch.Tensor) -> bool:
    # with AMX, oneDNN's packed copy runs prompts on the tiles and the AMX kernel batches
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[0] % PAIR_COLUMNS == 0
            and weight.shape[1] % 2 == 0 and (cpu_extension.has_avx512() or cpu_extension.widens_bf16())
            and cpu_extension.available() and not cpu_extension.has_amx())


@functools.cache
def widens_bf16_layers() -> bool:
    """Whether bf16 layers run as fp32 products over weights widened as they are read, not
    as bf16 matmuls: on a CPU without bf16 arithmetic where vlmserve's widening GEMV is
    built, or where oneDNN has no bf16 matmul at all. An AVX-512F CPU without AVX512-BF16
    has oneDNN's emulated one: 60 GFLOP/s against its fp32 matmul's 245 (a Xeon, 2 threads)."""
    return cpu_extension.widens_bf16() or not has_bf16_matmul()


@functools.cache
def has_bf16_matmul() -> bool:
    """Whether oneDNN has bf16 matmuls on this CPU (AVX-512 and up): below, torch's bf16
    matmul runs at about a tenth of fp32's speed."""
    try:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def one_row_on_pairs(weight: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether linear_cpu multiplies one bf16 row by this layer with bf16_batch_linear on
    its pair-layout copy."""
    return is_pair_layout(packed) and weight.dtype == torch.bfloat16 and cpu_extension.available()


def one_row_on_bf16_gemv(weight: torch.Tensor) -> bool:
    """Whether linear_cpu multiplies one bf16 row by this weight with bf16_gemv."""
    if weight.dtype != torch.bfloat16:
        return False
    if widens_bf16_layers():
        return _widening_gemv_fits(weight)
    return _gemv_fits(weight.new_empty((1, weight.shape[1])), weight)


def _widening_gemv_fits(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % 32 == 0 and weight.is_contiguous() and cpu_extension.widens_bf16()


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0
            and weight.is_contiguous() and cpu_extension.has_bf16_dot() and cpu_extension.available())


@register("silu_and_mul")
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@register("silu_and_mul", "cpu", available=cpu_extension.available)
def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    return cpu_kernels().silu_and_mul(gate_up)
