"""RMSNorm (computed in fp32, as the reference models do)."""

from __future__ import annotations

import torch

from vlmserve.kernels.registry import register


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)
