"""Reading the quantized checkpoints model makers publish: AWQ, GPTQ, compressed-tensors
and block-wise FP8, from `config.json`'s `quantization_config`.

Each format's tensors of one linear layer (`<prefix>.qweight`, `.qzeros`, `.scales`, ...)
are turned into one `<prefix>.weight` entry: a `QuantizedWeight` where the format maps
exactly onto vlmserve's int4 (values 0-15 with a scale and zero per group of inputs) or
int8 (one scale per output) weights, FP8's blocks onto fp8 weights (converted in the
kernels: no FP8 math on these CPUs), else the weight dequantized to the model's dtype —
GPTQ 8-bit (zero points per group), GPTQ with `desc_act` (groups that are not runs of
inputs). Everything else passes through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from vlmserve.kernels.quantized_linear import QuantizedWeight

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: word slot i holds output 8c + AWQ_ORDER[i]


class UnsupportedQuantization(ValueError):
    """A format, bit width or variant vlmserve does not load; the message names it."""


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # awq, gptq, compressed-tensors, fp8
    bits: int
    group_size: int  # inputs per scale; -1: one group per output row
    symmetric: bool = False
    desc_act: bool = False
    zeros_offset: int = 0  # GPTQ's first format stores each zero point minus one
    block: tuple[int, int] = (128, 128)  # FP8: outputs x inputs per scale

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor names (after `<prefix>.`) of one quantized linear layer."""
        return {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
                "fp8": ("weight", "weight_scale_inv")}.get(self.method, ())

    @classmethod
    def from_config(cls, config: dict | object | None) -> CheckpointQuantization | None:
        """The checkpoint's quantization, checked; None for an unquantized checkpoint."""
        if not config:
            return None
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        method = get("quant_method", "unknown")
        if method == "awq":
            if get("version", "gemm").lower() != "gemm" or get("bits", 4) != 4 or not get("zero_point", True):
                raise UnsupportedQuantization(f"awq {get('version', 'gemm')} {get('bits')}-bit (vlmserve loads AWQ "
                                              f"GEMM 4-bit with zero points)")
            return cls("awq", 4, get("group_size", 128))
        if method == "gptq":
            bits = get("bits", 4)
            if bits not in (4, 8):
                raise UnsupportedQuantization(f"gptq {bits}-bit (vlmserve loads 4 and 8 bits)")
            offset = 0 if get("checkpoint_format", "gptq") == "gptq_v2" else 1
            return cls("gptq", bits, get("group_size", 128), symmetric=get("sym", True),
                       desc_act=bool(get("desc_act", False)), zeros_offset=offset)
        if method == "fp8":
            block = get("weight_block_size")
            if not block or get("fmt", "e4m3") != "e4m3":
                raise UnsupportedQuantization("fp8 without weight_block_size (vlmserve loads block-wise e4m3)")
            return cls("fp8", 8, -1, block=(int(block[0]), int(block[1])))
        if method == "compressed-tensors":
            return _compressed_tensors(get)
        bits = get("bits")
        raise UnsupportedQuantization(method + (f" ({bits}-bit)" if bits else ""))


def _compressed_tensors(get) -> CheckpointQuantization:
    groups = list((get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantization(f"compressed-tensors with {len(groups)} config groups (vlmserve loads one)")
    weights = groups[0].get("weights") or {}
    fmt = groups[0].get("format") or get("format")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if fmt == "pack-quantized" and bits == 4 and kind == "int" and strategy in ("group", "channel"):
        return CheckpointQuantization("compressed-tensors/pack-quantized", 4, weights.get("group_size") or -1,
                                      symmetric=weights.get("symmetric", True))
    if fmt in ("int-quantized", "naive-quantized") and bits == 8 and kind == "int" and strategy == "channel" \
            and weights.get("symmetric", True):
        return CheckpointQuantization("compressed-tensors/int-quantized", 8, -1, symmetric=True)
    raise UnsupportedQuantization(f"compressed-tensors {fmt} {kind}{bits} ({strategy}) (vlmserve loads W4A16 "
                                  f"pack-quantized and W8A8 int8 per channel)")


def read_quantized(weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuantization,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized linear layer's parts turned into one
    `<prefix>.weight`: a QuantizedWeight in `dtype`, or the dequantized weight."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if not _is_part(quant, part, tensor):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if _complete(quant, parts):
            yield f"{prefix}.weight", _convert(quant, pending.pop(prefix), dtype, prefix)
    for prefix, parts in pending.items():  # GPTQ without g_idx, say
        if not all(p in parts for p in _required(quant)):
            raise ValueError(f"{prefix}: quantized weight incomplete in the checkpoint (has {sorted(parts)})")
        yield f"{prefix}.weight", _convert(quant, parts, dtype, prefix)


def _is_part(quant: CheckpointQuantization, part: str, tensor: torch.Tensor) -> bool:
    if quant.method == "gptq":
        return part in ("qweight", "qzeros", "scales", "g_idx")
    if quant.method == "compressed-tensors/pack-quantized":
        return part in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
    if quant.method == "compressed-tensors/int-quantized":
        return (part == "weight" and tensor.dtype == torch.int8) or part == "weight_scale"
    if quant.method == "fp8":
        return (part == "weight" and tensor.dtype == torch.float8_e4m3fn) or part == "weight_scale_inv"
    return part in quant.parts


def _required(quant: CheckpointQuantization) -> tuple[str, ...]:
    if quant.method == "compressed-tensors/pack-quantized":
        return ("weight_packed", "weight_scale", "weight_shape") + (() if quant.symmetric else ("weight_zero_point",))
    if quant.method == "compressed-tensors/int-quantized":
        return ("weight", "weight_scale")
    return quant.parts


def _complete(quant: CheckpointQuantization, parts: dict) -> bool:
    needed = _required(quant) + (("g_idx",) if quant.method == "gptq" else ())
    return all(p in parts for p in needed)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits values each, lowest bits first, unpacked along dim."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per word]
    values = values.movedim(-1, dim + 1) if dim != words.dim() - 1 else values
    shape = list(words.shape)
    shape[dim] *= 32 // bits
    return values.reshape(shape).to(torch.uint8 if bits <= 8 else torch.int32)


def _int4(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
          group: int) -> QuantizedWeight:
    """vlmserve's int4 weight from values [out, in] (0-15) and per-group scales and zero
    points [out, groups] in units of the values: w = (q - z) * s = q * s + (-z * s)."""
    scales = scales.float()
    return QuantizedWeight("int4", (values.shape[0], values.shape[1]), dtype, values[:, 0::2] | (values[:, 1::2] << 4),
                           scales.to(dtype), (-zeros.float() * scales).to(dtype), "plain", group)


def _grouped_dequantize(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_of: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)] for values [out, in], scales/zeros [out, groups]."""
    return ((values.float() - zeros.float()[:, group_of]) * scales.float()[:, group_of]).to(dtype)


def _convert(quant: CheckpointQuantization, parts: dict[str, torch.Tensor], dtype: torch.dtype,
             prefix: str) -> torch.Tensor | QuantizedWeight:
    if quant.method == "awq":
        order = torch.tensor(AWQ_ORDER).argsort()  # unpacked slot -> output within the word
        values = _unpack(parts["qweight"], 4, 1)  # [in, out] in packed order
        values = values.view(values.shape[0], -1, 8)[:, :, order].reshape(values.shape[0], -1).t().contiguous()
        zeros = _unpack(parts["qzeros"], 4, 1)
        zeros = zeros.view(zeros.shape[0], -1, 8)[:, :, order].reshape(zeros.shape[0], -1).t()
        group = quant.group_size if quant.group_size > 0 else values.shape[1]
        return _int4(values, parts["scales"].t(), zeros, dtype, group)
    if quant.method == "gptq":
        values = _unpack(parts["qweight"], quant.bits, 0).t().contiguous()  # [out, in]
        zeros = (_unpack(parts["qzeros"], quant.bits, 1).to(torch.int32) + quant.zeros_offset).t()  # [out, groups]
        scales = parts["scales"].t()
        inputs = values.shape[1]
        group = quant.group_size if quant.group_size > 0 else inputs
        runs = torch.arange(inputs) // group
        group_of = parts["g_idx"].long() if "g_idx" in parts else runs
        if quant.bits == 4 and torch.equal(group_of, runs):
            return _int4(values, scales, zeros, dtype, group)
        logger.debug("%s: GPTQ %d-bit%s runs dequantized", prefix, quant.bits,
                     " with desc_act" if quant.desc_act else "")
        return _grouped_dequantize(values, scales, zeros, group_of, dtype)
    if quant.method == "compressed-tensors/pack-quantized":
        out_features, in_features = (int(v) for v in parts["weight_shape"].tolist())
        values = _unpack(parts["weight_packed"], 4, 1)[:, :in_features].contiguous()  # stored as q + 8
        scales = parts["weight_scale"].reshape(out_features, -1)
        zeros = parts.get("weight_zero_point")  # signed; asymmetric ones packed along outputs as z + 8
        if zeros is None:
            zeros = torch.full_like(scales, 8.0, dtype=torch.float32)
        elif zeros.shape[0] != out_features:
            zeros = _unpack(zeros, 4, 0)[:out_features]
        else:
            zeros = zeros.float() + 8
        group = in_features // scales.shape[1]
        return _int4(values, scales, zeros, dtype, group)
    if quant.method == "compressed-tensors/int-quantized":
        weight = parts["weight"]
        return QuantizedWeight("int8", (weight.shape[0], weight.shape[1]), dtype, weight,
                               parts["weight_scale"].reshape(-1).to(dtype))
    if quant.method == "fp8":  # kept in 8 bits, each row carrying its blocks' scales
        weight, scale = parts["weight"], parts["weight_scale_inv"].float()
        rows, cols = quant.block
        blocks = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
        if tuple(scale.shape) != blocks:  # caught here, not as a kernel error at the first request
            raise ValueError(f"{prefix}.weight_scale_inv: shape {tuple(scale.shape)}, but a weight of "
                             f"{tuple(weight.shape)} in blocks of {rows}x{cols} has {blocks}")
        return QuantizedWeight("fp8", (weight.shape[0], weight.shape[1]), dtype, weight.contiguous(),
                               scale.repeat_interleave(rows, 0)[: weight.shape[0]].contiguous(), group=cols)
    raise AssertionError(quant.method)
