"""The CPU matmul kernels of a decode step, alone: vlmserve's bf16, int8, int4 and fp8
GEMVs (up to the rows the engine gives each), torch's packed int8/int4 kernels, a bf16
layer's matmul and the quantized weights' dequantized matmuls (what prompts run), on the
weights of Qwen2.5-VL-3B's layers, at a few rows of x. Kernels this CPU lacks are left out
(on AVX2 CPUs: fp8, torch's int4 layout; the bf16 matmul is then vlmserve's widened one). Each timed
pass goes over copies of the weight that add up to more than the L3 cache holds, so they
stream from memory as in a decode step;
each kernel's speed is printed in milliseconds per weight and in GB/s of its own bytes,
beside the machine's measured read bandwidth.

    python benchmarks/bench_quantized_kernels.py [--rows 1,4,16,32] [--stream-mb 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch

from common import cpu_flags, machine_limits
from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.linear import GEMV_MAX_ROWS, WIDENING_GEMV_MAX_ROWS, linear_cpu
from vlmserve.kernels.quantized_linear import (PACKED_MAX_ROWS, QuantizedWeight, dequantized_linear,
                                               own_kernels_available, prepare_quantized_weight_cpu, quantize,
                                               tiled_kernels_available, tiled_max_rows, torch_cpu_layout,
                                               torch_int4_layout_fits)
from vlmserve.models.quantized_checkpoints import CheckpointQuantization, read_quantized
from vlmserve.testing.quantized_checkpoints import fp8_blocks

SHAPES = {"22016 x 2048 (gate/up)": (22016, 2048), "2048 x 11008 (down)": (2048, 11008),
          "2560 x 2048 (q/k/v)": (2560, 2048)}


def fp8_weight(w: torch.Tensor) -> QuantizedWeight:
    """w as a block-wise FP8 checkpoint holds it, read by vlmserve's loader."""
    data, block_scales = fp8_blocks(w)
    quant = CheckpointQuantization.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    [(_, qw)] = read_quantized([("layer.weight", data), ("layer.weight_scale_inv", block_scales)], quant, torch.bfloat16)
    return qw


Kernel = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], int]


def kernels(w: torch.Tensor) -> dict[str, Kernel]:
    """Each kernel as a function of x and its weight's tensors, those tensors, and the most
    rows of x the engine gives it."""
    ops = cpu_kernels()
    int8 = quantize(w, "int8")
    int8_tiled = prepare_quantized_weight_cpu(int8)
    int4 = prepare_quantized_weight_cpu(quantize(w, "int4"))
    many = 1 << 20
    avx2 = cpu_extension.widens_bf16()
    table: dict[str, Kernel] = {
        "bf16 GEMV": (lambda x, w: ops.bf16_gemv(x, w, None), (w,), WIDENING_GEMV_MAX_ROWS if avx2 else GEMV_MAX_ROWS),
        "bf16 matmul": (lambda x, w: linear_cpu(x, w, None), (w,), many),  # no packed copy (AVX2: widened)
        "int8 GEMV": (lambda x, q, s: ops.int8_tiled_gemv(x, q, s, None), (int8_tiled.data, int8_tiled.scales),
                      tiled_max_rows("int8")),
        "int8 dequant": (lambda x, q, s: dequantized_linear(x, dataclasses.replace(int8_tiled, data=q, scales=s), None),
                         (int8_tiled.data, int8_tiled.scales), many),
        "int8 torch": (torch.ops.aten._weight_int8pack_mm, (int8.data, int8.scales), many),
        "int4 GEMV": (lambda x, q, s, z: ops.int4_gemv(x, q, s, z, None), (int4.data, int4.scales, int4.zeros),
                      tiled_max_rows("int4")),
        "int4 dequant": (lambda x, q, s, z: dequantized_linear(x, dataclasses.replace(int4, data=q, scales=s, zeros=z),
                                                               None), (int4.data, int4.scales, int4.zeros), many),
    }
    if torch_int4_layout_fits(int4):
        torch_int4 = torch_cpu_layout(quantize(w, "int4"))
        table["int4 torch"] = (lambda x, q, s: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, 128, s),
                               (torch_int4.data, torch_int4.scales), many)
    if own_kernels_available():
        fp8 = fp8_weight(w)
        table["fp8 GEMV"] = (lambda x, q, s: ops.fp8_gemv(x, q, s, None), (fp8.data.view(torch.uint8), fp8.scales),
                             PACKED_MAX_ROWS["fp8"])
    return table


def time_kernel(kernel: Kernel, rows: int, in_features: int, stream_bytes: float, repeats: int) -> str:
    """ms per weight (GB/s of its bytes), over copies of the weight that add up to
    stream_bytes: more than the L3 cache, so each call reads its weight from memory."""
    fn, tensors, most_rows = kernel
    if rows > most_rows:
        return "-"
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    copies = [tuple(t.clone() for t in tensors) for _ in range(max(2, math.ceil(stream_bytes / nbytes)))]
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    for c in copies:
        fn(x, *c)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for c in copies:
            fn(x, *c)
        times.append((time.perf_counter() - t) / len(copies))
    seconds = statistics.median(times)
    return f"{seconds * 1e3:.3f} ({nbytes / seconds / 1e9:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32", help="rows of x (tokens in the step)")
    ap.add_argument("--stream-mb", type=float, default=1024, help="bytes of weights per timed pass (above the L3)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not tiled_kernels_available():
        raise SystemExit("vlmserve's CPU kernels are not built on this machine (they need AVX512-VNNI or AVX2)")
    limits = machine_limits(args.threads)
    print(f"CPU: {cpu_flags()}; {args.threads} threads; machine read {limits['read_gbs']:.1f} GB/s")
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    for label, shape in SHAPES.items():
        table = kernels(torch.randn(shape, dtype=torch.bfloat16) * 0.02)
        print(f"\n{label}: ms per weight (GB/s of the kernel's bytes), median of {args.repeats}")
        print(f"{'kernel':<14}" + "".join(f"{f'{r} rows':>18}" for r in rows))
        for name, kernel in table.items():
            cells = [time_kernel(kernel, r, shape[1], args.stream_mb * 1e6, args.repeats) for r in rows]
            print(f"{name:<14}" + "".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
