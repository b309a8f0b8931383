"""RMSNorm (computed in fp32, as the reference models do): plain, zero-centred and gated;
on the CPU in one pass each (kernels/csrc/elementwise.cpp)."""

from __future__ import annotations

import torch

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.registry import register


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@register("rms_norm_zero_centered")
def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight), in fp32 (Qwen3-Next / Qwen3.5)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


@register("gated_rms_norm")
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) * silu(gate): the output norm of a Gated DeltaNet layer."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * torch.nn.functional.silu(gate.float())).to(dtype)


@register("rms_norm", "cpu", available=cpu_extension.available)
def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.vlmserve_cpu.rms_norm(x, weight, eps, False, None)


@register("rms_norm_zero_centered", "cpu", available=cpu_extension.available)
def rms_norm_zero_centered_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.vlmserve_cpu.rms_norm(x, weight, eps, True, None)


@register("gated_rms_norm", "cpu", available=cpu_extension.available)
def gated_rms_norm_cpu(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.vlmserve_cpu.rms_norm(x, weight, eps, False, gate)
