"""Triton kernels for the elementwise work of a decoder layer: RMSNorm (plain,
zero-centred, gated by silu), rotary embedding (rotate-half, whole or partial heads, so
M-RoPE too: the models build the cos/sin tables), and silu(gate) * up, fp32 inside,
rounded once to the output dtype; and a grammar's token bitmask over the logits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlmserve.kernels.registry import register


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, gate_ptr, out_ptr, dim, eps, offset,
                     HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32) + offset
    y = x / tl.sqrt(tl.sum(x * x) / dim + eps) * w
    if HAS_GATE:
        gate = tl.load(gate_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
        y = y * gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
              gate: torch.Tensor | None = None) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim
    if rows:
        _rms_norm_kernel[(rows,)](x, weight, gate.contiguous() if gate is not None else x, out, dim, eps, offset,
                                  HAS_GATE=gate is not None, BLOCK=triton.next_power_of_2(dim))
    return out


@register("rms_norm", "triton")
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, 0.0)


@register("rms_norm_zero_centered", "triton")
def rms_norm_zero_centered_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, 1.0)


@register("gated_rms_norm", "triton")
def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, 0.0, gate)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, dim, rot, BLOCK_HALF: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = rot // 2
    i = tl.arange(0, BLOCK_HALF)
    in_rot = i < half
    base = (token * heads + head) * dim
    a = tl.load(x_ptr + base + i, mask=in_rot, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + base + half + i, mask=in_rot, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + token * rot + i, mask=in_rot, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * rot + i, mask=in_rot, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * rot + half + i, mask=in_rot, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * rot + half + i, mask=in_rot, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + i, (a * cos1 - b * sin1).to(out_ptr.dtype.element_ty), mask=in_rot)
    tl.store(out_ptr + base + half + i, (b * cos2 + a * sin2).to(out_ptr.dtype.element_ty), mask=in_rot)
    d = tl.arange(0, BLOCK_D)
    rest = (d >= rot) & (d < dim)  # the channels past the rotary part are copied
    tl.store(out_ptr + base + d, tl.load(x_ptr + base + d, mask=rest), mask=rest)


@register("apply_rotary", "triton")
def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, rotary_dim]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    tokens, heads, dim = x.shape
    rot = cos.shape[-1]
    if tokens:
        _rotary_kernel[(tokens, heads)](x, cos.contiguous(), sin.contiguous(), out, heads, dim, rot,
                                        BLOCK_HALF=triton.next_power_of_2(max(rot // 2, 1)),
                                        BLOCK_D=triton.next_power_of_2(dim))
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


@register("silu_and_mul", "triton")
def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    rows = gate_up.numel() // (2 * n)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, 256))](gate_up, out, n, BLOCK=256)
    return out


@triton.jit
def _token_bitmask_kernel(logits_ptr, rows_ptr, mask_ptr, vocab, words, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i)
    in_vocab = tokens < vocab
    word = tl.load(mask_ptr + i * words + tokens // 32, mask=in_vocab & (tokens // 32 < words), other=0)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * vocab + tokens, float("-inf"), mask=in_vocab & ~allowed)


@register("apply_token_bitmask", "triton")
def apply_token_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """A grammar's token bitmask in place: every token whose bit is clear gets -inf."""
    n, vocab = rows.numel(), logits.shape[-1]
    if n:
        block = 1024
        _token_bitmask_kernel[(n, triton.cdiv(vocab, block))](logits, rows.to(torch.int64).contiguous(),
                                                             bitmask.contiguous(), vocab, bitmask.shape[1],
                                                             BLOCK=block)
