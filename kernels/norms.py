"""RMSNorm (computed in fp32, as the reference models do): plain, zero-centred and gated,
and each of the first two after a residual addition; on the CPU in one pass each
(kernels/csrc/elementwise.cpp)."""

from __future__ import annotations

import torch

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.registry import ops, register


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


@register("add_rms_norm")
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): a layer's residual sum (rounded to x's dtype, as the
    reference adds) and the next norm of it; the norm is the device's own."""
    total = x + delta
    return total, ops.rms_norm(total, weight, eps)


@register("add_rms_norm_zero_centered")
def add_rms_norm_zero_centered(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, ops.rms_norm_zero_centered(total, weight, eps)


@register("rms_norm", "cpu", available=cpu_extension.available)
def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu_kernels().rms_norm(x, weight, eps, False, None)


@register("rms_norm_zero_centered", "cpu", available=cpu_extension.available)
def rms_norm_zero_centered_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu_kernels().rms_norm(x, weight, eps, True, None)


@register("gated_rms_norm", "cpu", available=cpu_extension.available)
def gated_rms_norm_cpu(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu_kernels().rms_norm(x, weight, eps, False, gate)


@register("add_rms_norm", "cpu", available=cpu_extension.available)
def add_rms_norm_cpu(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_kernels().add_rms_norm(x, delta, weight, eps, False)


@register("add_rms_norm_zero_centered", "cpu", available=cpu_extension.available)
def add_rms_norm_zero_centered_cpu(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_kernels().add_rms_norm(x, delta, weight, eps, True)
