"""Rotary position embeddings (rotate-half layout), for 1-D, 2-D and M-RoPE positions.

Models turn positions into cos/sin tables once per step (shared by all layers); the op
rotates the first `cos.shape[-1]` channels of every head and leaves the rest (partial
rotary) untouched.
"""

from __future__ import annotations

import torch

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.registry import register


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@register("apply_rotary")
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, rotary_dim]."""
    rot = cos.shape[-1]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


@register("apply_rotary", "cpu", available=cpu_extension.available)
def apply_rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One pass in C++ (kernels/csrc/elementwise.cpp), x's dtype out."""
    return cpu_kernels().apply_rotary(x, cos, sin)
