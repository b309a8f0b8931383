"""Quantized copies of a checkpoint in the formats model makers publish, made offline, and
beside each the reference: the same checkpoint holding the weights the format stands for.

AWQ, GPTQ and block-wise FP8 are packed here from their specifications (AutoAWQ and
GPTQModel need a GPU build; transformers loads neither on a CPU); compressed-tensors
checkpoints are made by the `compressed-tensors` library itself, and transformers
decompresses them on a CPU, so they are their own reference.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0  # the largest float8_e4m3fn


def _language_linear(name: str, tensor: torch.Tensor, group: int = 128) -> bool:
    """A language layer's matrix whose shape the formats pack (whole groups, outputs in 8s)."""
    return (".layers." in name and "visual" not in name and name.endswith(".weight") and tensor.dim() == 2
            and tensor.shape[1] % group == 0 and tensor.shape[0] % 8 == 0)


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint values packed 32 / bits to an int32 word along dim, lowest bits first."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per_word, per_word)
    words = (v << (torch.arange(per_word) * bits)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as int32's two's complement
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _asymmetric(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of `group` inputs: values [out, in], fp16 scales and integer zeros [out, groups]."""
    top = (1 << bits) - 1
    g = w.float().view(w.shape[0], -1, group)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((high - low) / top).clamp(min=1e-8).half()
    zeros = torch.round(-low / scales.float()).clamp(0, top)
    values = torch.round(g / scales.float()[..., None] + zeros[..., None]).clamp(0, top)
    return values.view(w.shape).to(torch.int64), scales, zeros.to(torch.int64)


def _tensors(source: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one shard after another."""
    for shard in sorted(source.glob("*.safetensors")):
        yield from load_file(str(shard)).items()


def _symmetric(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As _asymmetric, the range centred on zero: the zero point is 2^(bits-1) everywhere."""
    top, zero = (1 << bits) - 1, 1 << (bits - 1)
    g = w.float().view(w.shape[0], -1, group)
    scales = (2 * g.abs().amax(-1) / top).clamp(min=1e-8).half()
    values = torch.round(g / scales.float()[..., None] + zero).clamp(0, top)
    return values.view(w.shape).to(torch.int64), scales, torch.full(scales.shape, zero, dtype=torch.int64)


def _save(source: Path, dest: Path, tensors: dict, quantization_config: dict | None) -> Path:
    shutil.copytree(source, dest)
    for old in dest.glob("*.safetensors*"):
        old.unlink()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((dest / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


def write_awq(source: str | Path, dest: str | Path, group: int = 128) -> tuple[Path, Path]:
    """AWQ GEMM 4-bit: qweight [in, out / 8] and qzeros [groups, out / 8] int32 (eight
    outputs a word, in AWQ's interleaved order), scales [groups, out] fp16; w = (q - z) * s.
    Returns the quantized checkpoint and its reference."""
    source, dest = Path(source), Path(dest)
    quantized, reference = {}, {}
    order = torch.tensor(AWQ_ORDER)
    for name, w in _tensors(source):
        if not _language_linear(name, w, group):
            quantized[name] = reference[name] = w
            continue
        values, scales, zeros = _asymmetric(w, 4, group)
        reference[name] = ((values - zeros.repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
                           ).to(w.dtype)
        prefix = name[: -len(".weight")]
        interleave = lambda t: t.view(t.shape[0], -1, 8)[:, :, order].reshape(t.shape)  # noqa: E731
        quantized[f"{prefix}.qweight"] = _pack(interleave(values.t().contiguous()), 4, 1)
        quantized[f"{prefix}.qzeros"] = _pack(interleave(zeros.t().contiguous()), 4, 1)
        quantized[f"{prefix}.scales"] = scales.t().contiguous()
    # the vision tower stays in bf16, and says so, as in the published Qwen-VL AWQ checkpoints
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": ["visual"]}
    return _save(source, dest, quantized, config), _save(source, Path(f"{dest}-reference"), reference, None)


def write_gptq(source: str | Path, dest: str | Path, bits: int = 4, group: int = 128, desc_act: bool = False,
               seed: int = 0, symmetric: bool = False) -> tuple[Path, Path]:
    """GPTQ (first checkpoint format): qweight [in * bits / 32, out] int32 (inputs packed),
    qzeros [groups, out * bits / 32] holding z - 1, scales [groups, out] fp16, g_idx [in]:
    input i belongs to group g_idx[i]; with desc_act the groups are a permutation's runs.
    symmetric (`sym`, as the published Qwen GPTQ releases): every zero point is 2^(bits-1)."""
    source, dest = Path(source), Path(dest)
    quantized, reference = {}, {}
    generator = torch.Generator().manual_seed(seed)
    quantize = _symmetric if symmetric else _asymmetric
    for name, w in _tensors(source):
        if not _language_linear(name, w, group):
            quantized[name] = reference[name] = w
            continue
        inputs = w.shape[1]
        order = torch.randperm(inputs, generator=generator) if desc_act else torch.arange(inputs)
        values, scales, zeros = quantize(w[:, order], bits, group)  # groups are runs of `order`
        g_idx = torch.empty(inputs, dtype=torch.int32)
        g_idx[order] = (torch.arange(inputs) // group).to(torch.int32)
        unpermuted = torch.empty_like(values)
        unpermuted[:, order] = values
        reference[name] = ((unpermuted - zeros[:, g_idx.long()]) * scales.float()[:, g_idx.long()]).to(w.dtype)
        prefix = name[: -len(".weight")]
        quantized[f"{prefix}.qweight"] = _pack(unpermuted.t().contiguous(), bits, 0)
        quantized[f"{prefix}.qzeros"] = _pack((zeros - 1).clamp(min=0).t().contiguous(), bits, 1)
        quantized[f"{prefix}.scales"] = scales.t().contiguous()
        quantized[f"{prefix}.g_idx"] = g_idx
        assert (zeros >= 1).all(), "the first format cannot store a zero point of 0"
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": symmetric,
              "checkpoint_format": "gptq"}
    return _save(source, dest, quantized, config), _save(source, Path(f"{dest}-reference"), reference, None)


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] weight as FP8 checkpoints hold it: float8_e4m3fn values and an fp32
    scale per block of block x block weights (its largest magnitude / 448)."""
    out_features, in_features = w.shape
    rows, cols = -(-out_features // block), -(-in_features // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_features, :in_features] = w.float()
    scale = (padded.view(rows, block, cols, block).abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / _spread(scale, block, w.shape)).to(torch.float8_e4m3fn), scale


def _spread(scale: torch.Tensor, block: int, shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


def write_fp8(source: str | Path, dest: str | Path, block: int = 128) -> tuple[Path, Path]:
    """Block-wise FP8: weight float8_e4m3fn, weight_scale_inv [ceil(out / b), ceil(in / b)]
    fp32; w = fp8 * scale of its block."""
    source, dest = Path(source), Path(dest)
    quantized, reference = {}, {}
    for name, w in _tensors(source):
        if not _language_linear(name, w, 1):
            quantized[name] = reference[name] = w
            continue
        fp8, scale = fp8_blocks(w, block)
        reference[name] = (fp8.float() * _spread(scale, block, w.shape)).to(w.dtype)
        quantized[name], quantized[f"{name}_scale_inv"] = fp8, scale
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    return _save(source, dest, quantized, config), _save(source, Path(f"{dest}-reference"), reference, None)


def write_compressed_tensors(source: str | Path, dest: str | Path, scheme: str) -> Path:
    """W4A16 (pack-quantized int4, asymmetric, groups of 128) or W8A8 (int8 weights per
    channel, int8 activations per token, dynamic) by the compressed-tensors library, with
    min-max scales; the checkpoint is its own reference (transformers decompresses it)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForImageTextToText

    source, dest = Path(source), Path(dest)
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    if scheme == "W4A16":
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128)
        activations, fmt = None, "pack-quantized"
    elif scheme == "W8A8":
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        activations = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        fmt = "int-quantized"
    else:
        raise ValueError(scheme)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=activations)}, ignore=["lm_head", "re:.*visual.*"],
        format=fmt)
    apply_quantization_config(model, config)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data.float()
        if scheme == "W4A16":  # signed values in [-8, 7]: w = (q - zp) * s
            g = w.view(w.shape[0], -1, 128)
            low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-8)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
            module.weight_zero_point.data = torch.round(-8 - low / scale).to(module.weight_zero_point.dtype)
        else:
            module.weight_scale.data = (w.abs().amax(1, keepdim=True) / 127).to(module.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    shutil.copytree(source, dest)
    for old in dest.glob("*.safetensors*"):
        old.unlink()
    model.save_pretrained(str(dest))
    compressor.update_config(str(dest))
    return dest
