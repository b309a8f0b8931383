"""Weight-only quantized linear layers: a bf16/fp32 weight quantized once at load to int8
(one scale per output channel) or int4 (asymmetric, one scale and zero point per group of
128 inputs), and the matmul on it.

Decoding reads every weight once per step, so 8-bit weights read half the bytes of bf16
and 4-bit ones a quarter. On the CPU, with bf16 activations, up to 64 rows run on
vlmserve's own kernels (csrc/gemv_int8.cpp, gemv_int4.cpp), which take int8 and int4 weights in one tiled
layout (16 rows a tile, on huge pages) and multiply them with x quantized to int8 per
group by AVX512-VNNI: at one row they stream the weight near the machine's bandwidth
(int8 1.8-2.0x, int4 3.4-4.0x a bf16 GEMV at 3B widths), at 16-64 rows 3-4x torch's
packed-weight kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), which stay
for CPUs without the extension. Many rows (a prefill) are bound by compute, where those
kernels are several times slower than a bf16 matmul (measured, docs/quantization.md), so
the weight is dequantized on the fly and multiplied as a plain layer's weight.
CPUs with AVX2 and no AVX-512 run the same layout on the kernels' AVX2 versions
(csrc/int_gemv_avx2.h) at every row count: there is no bf16 matmul there, and their byte
products beat dequantizing and fp32 matmuls for prompts too.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.huge_pages import zeros_on_huge_pages
from vlmserve.kernels.linear import GEMV_MAX_ROWS, linear_cpu, reusable_buffer
from vlmserve.kernels.registry import register

METHODS = ("int8", "int4")
INT4_GROUP = 128
QUANTIZE_BLOCK = 1 << 18  # weights quantized per pass: fp32 temporaries of 1 MB, reused block after block
# up to this many rows torch's packed-weight kernels beat dequantizing and a bf16 matmul
# (measured at 3B widths on an AMX CPU; docs/quantization.md)
# (fp8: vlmserve's kernel, which converts the weights again for every 4 rows)
PACKED_MAX_ROWS = {"int8": 24, "int4": 128, "fp8": 8}
# vlmserve's tiled-layout kernels: beyond, dequantizing and a bf16 matmul win (measured on
# AVX-512 CPUs). Their AVX2 versions take every row count: there maddubs multiplies 32 weight
# bytes an instruction where an fp32 FMA takes 8 values, so they beat dequantizing and fp32
# matmuls from 1 to 512 rows (1.3-2.8x at 64-512 rows, Qwen2.5-VL-3B's matrices, Zen 3)
TILED_MAX_ROWS = {"int8": 64, "int4": 64}
GEMV_TILE = 16  # weight rows per tile in vlmserve's int8/int4 layout (one a 32-bit lane of AVX-512)


@dataclass
class QuantizedWeight:
    """A [out, in] weight, quantized. int8: `scales` [out] and `data` either "plain", int8
    [out, in], or "gemv", vlmserve's CPU kernel's tiled layout: uint8 w + 128, in tiles of 16
    rows, for each tile and group of 128 inputs 32 vectors of 64 bytes, vector v holding in
    its 4-byte lane r row r's inputs 4v..4v+3.
    int4: `scales` and `zeros` [out, in / group], w = q * scale + zero, and `data` the
    values two to a byte in one of three layouts: "plain", [out, in / 2] with input 2j in the
    low nibble and 2j + 1 in the high one; "gemv", vlmserve's CPU kernel's, in tiles of 16
    rows: for each tile and group of 128 inputs 16 vectors of 64 bytes, vector v holding
    in its 4-byte lane r row r's inputs 4v..4v+3 (low nibbles) and 64+4v..64+4v+3 (high),
    `scales` and `zeros` [out / 16, in / 128, 16]; or "cpu_blocked", torch's CPU kernel's (for
    each block of 64 outputs, input-major, outputs j and j + 32 of the block in one byte's
    low and high nibbles), where the scales and zeros are kept as that kernel takes them:
    `scales` [in / group, out, 2] of (scale, zero + 8 * scale), `zeros` None. The group is
    128 inputs when vlmserve quantizes; a published checkpoint's may be 32 to 256.
    fp8 (FP8 checkpoints): `data` float8_e4m3fn [out, in], `scales` fp32 [out, in / group]
    (each block of 128 x 128 weights' scale, repeated over its rows)."""

    method: str
    shape: tuple[int, int]
    dtype: torch.dtype  # the activations' (and the dequantized weight's) dtype
    data: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    layout: str = "plain"
    group: int = INT4_GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.zeros) if t is not None)

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The weight with fn applied to its tensors (a module's `.to(device)`)."""
        return dataclasses.replace(self, data=fn(self.data), scales=fn(self.scales),
                                   zeros=None if self.zeros is None else fn(self.zeros))


def quantizable(weight: torch.Tensor, method: str) -> bool:
    """int4 needs whole groups of 128 inputs."""
    return method == "int8" or weight.shape[1] % INT4_GROUP == 0


def quantize(weight: torch.Tensor, method: str, group: int = INT4_GROUP,
             row_absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a [out, in] weight (computed in fp32); int4 in
    groups of `group` inputs. Rows are quantized a block at a time into preallocated
    outputs, so that the fp32 temporaries stay small (a 151,936-row head in fp32 would
    be over a gigabyte). row_absmax: int8's per-row maxima where the weight is part of
    wider rows (a rank's columns), so that its scales are the whole rows'."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {list(METHODS)}, got {method!r}")
    shape, dtype = (weight.shape[0], weight.shape[1]), weight.dtype
    rows = max(1, QUANTIZE_BLOCK // shape[1])
    if method == "int8":
        data = torch.empty(shape, dtype=torch.int8)
        scales = torch.empty(shape[0], dtype=dtype)
        for start in range(0, shape[0], rows):
            w = weight[start : start + rows].detach().float()
            top = w.abs().amax(dim=1) if row_absmax is None else row_absmax[start : start + rows]
            scale = (top / 127).clamp(min=1e-12)
            data[start : start + rows] = torch.round(w / scale[:, None]).clamp(-127, 127)
            scales[start : start + rows] = scale
        return QuantizedWeight(method, shape, dtype, data, scales)
    data = torch.empty(shape[0], shape[1] // 2, dtype=torch.uint8)
    scales = torch.empty(shape[0], shape[1] // group, dtype=dtype)
    zeros = torch.empty_like(scales)
    for start in range(0, shape[0], rows):
        w = weight[start : start + rows].detach().float()
        groups = w.view(w.shape[0], shape[1] // group, group)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(w.shape)
        data[start : start + rows] = q[:, 0::2] | (q[:, 1::2] << 4)
        scales[start : start + rows], zeros[start : start + rows] = scale, low
    return QuantizedWeight(method, shape, dtype, data, scales, zeros, "plain", group)


def int4_values(qw: QuantizedWeight) -> torch.Tensor:
    """The 4-bit values as uint8 [out, in]."""
    out_features, in_features = qw.shape
    if qw.layout == "plain":
        return torch.stack((qw.data & 15, qw.data >> 4), dim=-1).view(qw.shape)
    if qw.layout == "gemv":  # [tile, group, v, r, byte] -> [tile, r, group, nibble, v, byte]
        tiles = qw.data.view(out_features // GEMV_TILE, -1, 16, GEMV_TILE, 4)
        return torch.stack((tiles & 15, tiles >> 4), dim=1).permute(0, 4, 2, 1, 3, 5).reshape(qw.shape)
    blocks = qw.data.view(out_features // 64, in_features, 32)
    return torch.stack((blocks & 15, blocks >> 4), dim=1).permute(0, 1, 3, 2).reshape(qw.shape)


def int8_values(qw: QuantizedWeight) -> torch.Tensor:
    """The 8-bit values as int8 [out, in]."""
    if qw.layout == "plain":
        return qw.data
    tiles = qw.data.view(qw.shape[0] // GEMV_TILE, -1, 32, GEMV_TILE, 4)  # [tile, group, v, r, byte]
    return tiles.permute(0, 3, 1, 2, 4).reshape(qw.shape).bitwise_xor(128).view(torch.int8)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The [out, in] weight in its dtype."""
    if qw.method == "int8":
        return int8_values(qw).to(qw.dtype) * qw.scales[:, None]
    if qw.method == "fp8":
        return (qw.data.float() * qw.scales.repeat_interleave(qw.group, 1)[:, : qw.shape[1]]).to(qw.dtype)
    q = int4_values(qw).view(qw.shape[0], -1, qw.group).to(qw.dtype)
    if qw.layout == "gemv":
        scales, zeros = (_untiled(t) for t in (qw.scales, qw.zeros))
        return (q * scales[..., None] + zeros[..., None]).view(qw.shape)
    if qw.layout == "plain":
        return (q * qw.scales[..., None] + qw.zeros[..., None]).view(qw.shape)
    scale, zero = qw.scales[..., 0].t(), qw.scales[..., 1].t()  # [out, groups]
    return ((q - 8) * scale[..., None] + zero[..., None]).view(qw.shape)


@register("prepare_quantized_weight")
def prepare_quantized_weight(qw: QuantizedWeight) -> QuantizedWeight:
    return qw


@register("prepare_quantized_weight", "cpu")
def prepare_quantized_weight_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    """int8 and int4 bf16 weights in vlmserve's CPU kernels' layout (tiles of 16 rows, groups
    of 128 inputs); else int4 in torch's (its blocks are 64 outputs: other widths stay plain
    and run dequantized) and int8 plain."""
    if qw.method not in METHODS or qw.dtype != torch.bfloat16:
        return qw
    if gemv_layout_fits(qw):
        return gemv_layout(qw)
    return torch_cpu_layout(qw) if qw.method == "int4" and torch_int4_layout_fits(qw) else qw


def torch_int4_layout_fits(qw: QuantizedWeight) -> bool:
    """Whole blocks of 64 outputs, on a CPU where torch packs int4 in the layout
    `int4_values` reads (its AVX-512 one: on AVX2 CPUs it packs otherwise, and the prompt's
    dequantized matmul read wrong values)."""
    return qw.shape[0] % 64 == 0 and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def gemv_layout_fits(qw: QuantizedWeight) -> bool:
    return (qw.group == INT4_GROUP and qw.shape[0] % GEMV_TILE == 0 and qw.shape[1] % INT4_GROUP == 0
            and tiled_kernels_available())


def gemv_layout(qw: QuantizedWeight) -> QuantizedWeight:
    """A plain int8 or int4 weight (rows a multiple of 16; int4 in groups of 128) in
    vlmserve's CPU kernels' tiled layout, on huge pages (the GEMVs stream it every step)."""
    tiled = zeros_on_huge_pages(qw.data.shape, torch.uint8)
    if qw.method == "int8":
        rows = qw.data.view(torch.uint8).view(qw.shape[0] // GEMV_TILE, GEMV_TILE, -1, 32, 4)  # [tile, r, group, v, byte]
        tiled.view(rows.shape[0], rows.shape[2], 32, GEMV_TILE, 4).copy_(rows.permute(0, 2, 3, 1, 4))
        return dataclasses.replace(qw, data=tiled.bitwise_xor_(128), layout="gemv")  # w + 128: one xor of the sign
    tiles = int4_values(qw).view(qw.shape[0] // GEMV_TILE, GEMV_TILE, -1, 2, 16, 4)  # [tile, r, group, nibble, v, byte]
    packed = (tiles[:, :, :, 0] | (tiles[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [tile, group, v, r, byte]
    tiled.view(packed.shape).copy_(packed)
    tile_major = lambda t: t.view(qw.shape[0] // GEMV_TILE, GEMV_TILE, -1).transpose(1, 2).contiguous()  # noqa: E731
    return QuantizedWeight(qw.method, qw.shape, qw.dtype, tiled, tile_major(qw.scales), tile_major(qw.zeros), "gemv",
                           qw.group)


def _untiled(t: torch.Tensor) -> torch.Tensor:
    """[out / 16, groups, 16] scales or zeros of the "gemv" layout as [out, groups]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def torch_cpu_layout(qw: QuantizedWeight) -> QuantizedWeight:
    """A plain bf16 int4 weight (whole blocks of 64 outputs) in torch's CPU kernel's layout."""
    blocked = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4_values(qw).to(torch.int32), 1)
    scales_and_zeros = torch.stack((qw.scales.t(), (qw.zeros + 8 * qw.scales).t()), dim=-1).contiguous()
    return QuantizedWeight(qw.method, qw.shape, qw.dtype, blocked, scales_and_zeros, None, "cpu_blocked", qw.group)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Several plain quantized weights of one input, stacked (a fused projection's shards):
    every row is quantized on its own, so stacking them is exact."""
    first = parts[0]
    if any((p.method, p.dtype, p.group, p.layout, p.shape[1]) != (first.method, first.dtype, first.group, "plain",
                                                                   first.shape[1]) for p in parts):
        raise ValueError("fused shards quantized differently")
    cat = lambda tensors: None if tensors[0] is None else torch.cat(tensors)  # noqa: E731
    return QuantizedWeight(first.method, (sum(p.shape[0] for p in parts), first.shape[1]), first.dtype,
                           cat([p.data for p in parts]), cat([p.scales for p in parts]), cat([p.zeros for p in parts]),
                           "plain", first.group)


@register("quantized_linear")
def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dequantize(qw), bias)


@register("quantized_linear", "cpu")
def quantized_linear_cpu(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if qw.layout == "gemv" and 0 < rows <= tiled_max_rows(qw.method) and x.dtype == qw.dtype:
        if qw.method == "int8":
            return cpu_kernels().int8_tiled_gemv(x, qw.data, qw.scales, bias)
        return cpu_kernels().int4_gemv(x, qw.data, qw.scales, qw.zeros, bias)
    if not 0 < rows <= PACKED_MAX_ROWS[qw.method] or x.dtype != qw.dtype or qw.layout == "gemv":
        return dequantized_linear(x, qw, bias)
    flat = x.reshape(rows, x.shape[-1])
    if qw.method == "fp8" and _fp8_kernels_fit(qw):
        return cpu_kernels().fp8_gemv(x, qw.data.view(torch.uint8), qw.scales, bias)
    if qw.method == "int8" and rows <= GEMV_MAX_ROWS and _int8_gemv_fits(qw):
        return cpu_kernels().int8_gemv(x, qw.data, qw.scales, bias)
    if qw.method == "int8":
        out = torch.ops.aten._weight_int8pack_mm(flat, qw.data, qw.scales)
    elif qw.layout == "cpu_blocked":
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, qw.data, qw.group, qw.scales)
    else:
        return dequantized_linear(x, qw, bias)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


def dequantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x times the weight dequantized on the fly (a prompt's matmul on AVX-512 CPUs, bound
    by compute) into one scratch buffer, as a plain layer's matmul."""
    return linear_cpu(x, _dequantize_to_scratch(qw), bias)


def _int8_gemv_fits(qw: QuantizedWeight) -> bool:
    return qw.shape[1] % 32 == 0 and own_kernels_available()


def _fp8_kernels_fit(qw: QuantizedWeight) -> bool:
    return qw.group == 128 and qw.shape[1] % 128 == 0 and own_kernels_available()


def own_kernels_available() -> bool:
    """vlmserve's compiled CPU kernels, with the AVX512-BF16 (and VNNI) they are built for."""
    return cpu_extension.has_bf16_dot() and cpu_extension.available()


def tiled_max_rows(method: str) -> int:
    return sys.maxsize if cpu_extension.widens_bf16() else TILED_MAX_ROWS[method]


def tiled_kernels_available() -> bool:
    """vlmserve's int8/int4 kernels on the tiled layout: built for AVX512-VNNI, or for AVX2
    (csrc/int_gemv_avx2.h) on CPUs without AVX-512."""
    return own_kernels_available() or cpu_extension.widens_bf16()


_scratch: dict[torch.dtype, torch.Tensor] = {}


def _dequantize_to_scratch(qw: QuantizedWeight) -> torch.Tensor:
    """`dequantize`, into one buffer reused by every layer (the largest weight's size):
    a fresh tensor of a layer's size per call costs more in page faults than the
    arithmetic (measured: int8 -> bf16 of 45M weights 70 ms fresh, 11 ms in place)."""
    numel = qw.shape[0] * qw.shape[1]
    buffer = _scratch.get(qw.dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch[qw.dtype] = reusable_buffer(numel, qw.dtype)
    w = buffer[:numel].view(qw.shape)
    if qw.method == "fp8":
        if _fp8_kernels_fit(qw):
            cpu_kernels().fp8_dequantize(qw.data.view(torch.uint8), qw.scales, w)
            return w
        return w.copy_(dequantize(qw))
    if qw.method == "int8" and qw.layout == "gemv":
        cpu_kernels().int8_tiled_dequantize(qw.data, qw.scales, w)
        return w
    if qw.method == "int8":
        return w.copy_(qw.data).mul_(qw.scales[:, None])
    if qw.layout == "gemv":
        cpu_kernels().int4_dequantize(qw.data, qw.scales, qw.zeros, w)
        return w
    grouped = w.view(qw.shape[0], -1, qw.group).copy_(int4_values(qw).view(qw.shape[0], -1, qw.group))
    if qw.layout != "cpu_blocked":
        return grouped.mul_(qw.scales[..., None]).add_(qw.zeros[..., None]).view(qw.shape)
    scale, zero = qw.scales[..., 0].t(), qw.scales[..., 1].t()  # w = (q - 8) * scale + zero'
    return grouped.sub_(8).mul_(scale[..., None]).add_(zero[..., None]).view(qw.shape)
