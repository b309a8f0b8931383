"""Sampling's kernels: a grammar's token bitmask applied to logits in place (int32 words:
bit j of word w allows token 32w + j; every other token gets -inf): unpacked with torch
anywhere, one pass in C++ on the CPU (kernels/csrc/sampling.cpp), a Triton kernel on GPUs;
and greedy decoding's argmax over each row of fp32 or bf16 logits (torch's anywhere, on
the CPU two vector passes in C++ that read bf16 logits as they are)."""

from __future__ import annotations

import torch

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.registry import register

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, words] int32 -> [n, vocab] bool (tokens past the mask: not allowed)."""
    bits = ((bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1).bool().flatten(1)[:, :vocab]
    if bits.shape[1] < vocab:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)
    return bits


@register("apply_token_bitmask")
def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    logits[rows] = logits[rows].masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))


@register("apply_token_bitmask", "cpu", available=cpu_extension.available)
def apply_token_bitmask_cpu(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    cpu_kernels().apply_token_bitmask(logits, rows, bitmask)


@register("argmax_rows")
def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] fp32 or bf16 -> [rows] int64: each row's first index of its largest logit."""
    return logits.argmax(dim=-1)


@register("argmax_rows", "cpu", available=cpu_extension.available)
def argmax_rows_cpu(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype not in (torch.float32, torch.bfloat16):
        return logits.argmax(dim=-1)
    return cpu_kernels().argmax_rows(logits)
